"""The services' SSH identity: the key and known_hosts the units read, in their own home.

The units hide /home, /root and /run/user (ProtectHome=yes) and give each service a /tmp of its
own (PrivateTmp=yes), and they run as the user ``vllm-redeploy`` whose home is
/var/lib/vllm-redeploy: a ``~`` in the cluster file means that home for them. install-controller
refuses a file that names a key or known_hosts they could not read, makes the directory they go
in, and says what is still missing there with the commands that put it there. A person runs the
commands by hand as that same user (``sudo -u vllm-redeploy``), so both use one identity.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

SERVICE_USER = "vllm-redeploy"
HOME = "/var/lib/vllm-redeploy"
SSH_DIR = f"{HOME}/.ssh"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"  # the configuration's default (vllm_redeploy.config)
DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")  # what paramiko looks for without key_file
HIDDEN = ("/home/", "/root/", "/run/user/")  # ProtectHome=yes
PRIVATE = ("/tmp/", "/var/tmp/")  # noqa: S108 - PrivateTmp=yes: what the units do not see


def named_files(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, path as written) of every SSH file the cluster file makes the services read."""
    ssh = data.get("ssh") if isinstance(data.get("ssh"), dict) else {}
    files = [("ssh.known_hosts", str(ssh.get("known_hosts", DEFAULT_KNOWN_HOSTS)))]
    if ssh.get("key_file"):
        files.append(("ssh.key_file", str(ssh["key_file"])))
    nodes = data.get("nodes") if isinstance(data.get("nodes"), list) else []
    for i, node in enumerate(nodes):
        if isinstance(node, dict) and node.get("ssh_key_file"):
            files.append((f"nodes[{i}].ssh_key_file", str(node["ssh_key_file"])))
    return files


def for_services(path: str) -> str | None:
    """Where the units read ``path``: ``~`` is their home; None for a path relative to a
    directory (a shell's, another user's home) that they do not share."""
    if path == "~" or path.startswith("~/"):
        return HOME + path[1:]
    return path if path.startswith("/") else None


def unseen(data: dict[str, Any]) -> str | None:
    """Why the units could not read an SSH file the cluster file names, with the fix; or None."""
    for key, path in named_files(data):
        where = for_services(path)
        if where is None:
            why = "is relative to a directory the services do not run in"
        elif (where.rstrip("/") + "/").startswith(HIDDEN):
            why = "is under /home, /root or /run/user, which the units hide (ProtectHome=yes)"
        elif where.startswith(PRIVATE):
            why = "is in /tmp or /var/tmp, which each unit has its own of (PrivateTmp=yes)"
        else:
            continue
        return (
            f"install-controller: {key} ({path}) {why}: the services' SSH connections would "
            "fail, so nothing was installed. Keep the services' key and known_hosts in their "
            f"home: sudo install -d -m 0700 -o {SERVICE_USER} -g {SERVICE_USER} {SSH_DIR}, "
            f"copy the files there (owner {SERVICE_USER}, the key 0600) and name them in the "
            f'file as "{SSH_DIR}/..." (or "~/.ssh/...", which the services read there)'
        )
    return None


def make_dir(root: Path, uid: int, gid: int) -> list[str]:
    """The services' home and its .ssh, theirs and 0700 (as systemd's StateDirectory= keeps the
    home): where the operator puts the files, and where runs by hand as that user keep state."""
    how = "unchanged"
    for path in (root / HOME.lstrip("/"), root / SSH_DIR.lstrip("/")):
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True)
            how = "made"
        stat = path.stat()
        if (stat.st_uid, stat.st_gid, stat.st_mode & 0o777) != (uid, gid, 0o700):
            os.chown(path, uid, gid)
            path.chmod(0o700)
            how = "made" if how == "made" else "repaired"
    if how == "unchanged":
        return [f"{SSH_DIR}: unchanged"]
    return [f"{SSH_DIR}: {how} (0700, {SERVICE_USER}'s: the services' SSH key and known_hosts)"]


def missing(root: Path, data: dict[str, Any]) -> list[str]:
    """A note per SSH file the services would need and do not have yet, with its command."""
    notes = []
    files = dict(named_files(data))
    keys = [for_services(p) for k, p in files.items() if k != "ssh.known_hosts"]
    if not keys and not any((root / SSH_DIR.lstrip("/") / k).exists() for k in DEFAULT_KEYS):
        keys = [f"{SSH_DIR}/id_ed25519"]
    for key in keys:
        if key and not (root / key.lstrip("/")).exists():
            notes.append(
                f"note: the services' SSH key {key} does not exist; make it with "
                f"sudo -u {SERVICE_USER} ssh-keygen -t ed25519 -N '' -f {shlex.quote(key)} and "
                "add its .pub to ~/.ssh/authorized_keys of each node's login"
            )
    known_hosts = for_services(files["ssh.known_hosts"])
    if known_hosts and not (root / known_hosts.lstrip("/")).exists():
        tee = f"sudo -u {SERVICE_USER} tee -a {shlex.quote(known_hosts)}"
        scans = [f"ssh-keyscan -t ed25519 {hosts} | {tee}" for hosts in _hosts_by_port(data)]
        notes.append(
            f"note: the services' known_hosts {known_hosts} does not exist, so every node would "
            f"be refused; check each node's fingerprint on its console, then: {'; '.join(scans)}"
        )
    return notes


def _hosts_by_port(data: dict[str, Any]) -> list[str]:
    """ssh-keyscan's arguments for the nodes: ``-p PORT`` before those not on 22."""
    nodes = data.get("nodes") if isinstance(data.get("nodes"), list) else []
    ports: dict[int, list[str]] = {}
    for node in nodes:
        if isinstance(node, dict) and node.get("address"):
            port = int(node.get("ssh_port") or 22)
            ports.setdefault(port, []).append(shlex.quote(str(node["address"])))
    if not ports:
        return ["NODE..."]
    return [(f"-p {p} " if p != 22 else "") + " ".join(hosts) for p, hosts in ports.items()]
