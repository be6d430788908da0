"""A real OpenSSH server on its own loopback address, with its own host key."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.testbed.procs import free_port, kill_tree, spawn, wait_until

SSHD = "/usr/sbin/sshd"


def keygen(path: Path, kind: str = "ed25519") -> Path:
    """A new key pair at ``path`` (private) and ``path.pub``."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
    )
    return path


@dataclass
class SSHServer:
    """sshd -D on ``host``; accepts ``authorized_keys`` for any user; ``env`` via SetEnv."""

    root: Path
    host: str
    authorized_keys: list[Path]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    host_key: Path | None = None
    pid: int = 0
    enter: list[str] = field(default_factory=list)  # a prefix that runs it elsewhere (nsenter)
    options: list[str] = field(default_factory=list)  # more sshd_config lines

    def start(self) -> SSHServer:
        self.root.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        if self.host_key is None:
            self.host_key = keygen(self.root / "ssh_host_ed25519_key")
        auth = self.root / "authorized_keys"
        auth.write_text("".join(Path(f"{k}.pub").read_text() for k in self.authorized_keys))
        auth.chmod(0o644)  # sshd reads it as the user logging in (public keys only)
        self.port = self.port or free_port(self.host)
        set_env = " ".join(f'"{k}={v}"' for k, v in self.env.items())
        config = self.root / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.host}:{self.port}",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {auth}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PrintMotd no",
                    # OpenSSH's own limits (MaxSessions 10, MaxStartups 10:30:100), as on a
                    # real host: the product must stay within them.
                    *self.options,
                    *([f"SetEnv {set_env}"] if set_env else []),
                    "",
                ]
            )
        )
        argv = [*self.enter, SSHD, "-D", "-e", "-f", str(config)]
        self.pid = spawn(argv, self.root / "sshd.log").pid
        wait_until(self._banner, 10, f"sshd on {self.host}:{self.port}", self.root / "sshd.log")
        return self

    def _banner(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=1) as s:
            return s.recv(64).startswith(b"SSH-2.0")

    def known_hosts_line(self) -> str:
        assert self.host_key is not None
        kind, key = Path(f"{self.host_key}.pub").read_text().split()[:2]
        return f"[{self.host}]:{self.port} {kind} {key}\n"

    def drop_connections(self) -> int:
        """Kill every per-connection sshd (a cut link), with what runs below it: the session
        process that privilege separation runs as the login, which holds the socket too. The
        listener stays. Returns how many connections were cut."""
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        below = list(pids)
        for pid in below:  # grows as it goes: children, their children, ...
            found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
            below += [int(p) for p in found.stdout.split()]
        if below:
            subprocess.run(["kill", "-9", *map(str, below)], check=False)
        return len(pids)

    def stop(self) -> None:
        """Stop the listener and every session it serves (as at power-off)."""
        if self.pid:
            kill_tree(self.pid, grace=5)
            self.pid = 0
