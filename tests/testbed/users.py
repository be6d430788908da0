"""The node's login: ``nvidia``, as NVIDIA's two-Spark playbook makes it, never root.

Written into the node's own /etc and /home (overlays, tests.testbed.namespace) before it first
boots: the host's accounts plus ``nvidia`` (in adm, sudo and docker, as the first user of DGX OS),
a home of its own, and what sudo lets it do without a password:

- ``"all"``: ``nvidia ALL=(ALL) NOPASSWD: ALL`` (what many set up on day one);
- ``"units"``: only the stopping and disabling of the old stack's unit, each command exactly;
- ``"none"``: nothing; in the sudo group, sudo asks for a password the account does not have, so
  ``sudo -n`` answers "a password is required", as on a host where nobody allowed it.
"""

from __future__ import annotations

import os
from pathlib import Path

LOGIN = "nvidia"
SUDO_KINDS = ("all", "units", "none")
GROUPS = ("adm", "sudo", "docker")


def _entries(path: Path) -> list[list[str]]:
    return [line.split(":") for line in path.read_text().splitlines() if line.strip()]


def _free_id(*tables: list[list[str]]) -> int:
    taken = {int(e[2]) for table in tables for e in table if e[2].isdigit()}
    return next(i for i in range(1000, 60000) if i not in taken)


def login_ids() -> tuple[int, int]:
    """The uid and gid ``nvidia`` gets: the first both free on the host."""
    passwd, group = _entries(Path("/etc/passwd")), _entries(Path("/etc/group"))
    uid = _free_id(passwd, group)
    return uid, uid


def write_login(etc: Path, home: Path, sudo: str, tools: Path, units: list[str], path: str) -> None:
    """``etc`` and ``home``: the node's upper dirs of /etc and /home. ``tools``: where its host
    tools (systemctl, ...) are, first on root's PATH under sudo too (``path`` the rest), as the
    real ones are in /usr/bin; ``units``: what the ``"units"`` kind may stop and disable."""
    systemctl = tools / "systemctl"
    if sudo not in SUDO_KINDS:
        raise ValueError(f"sudo {sudo!r}: one of {SUDO_KINDS}")
    uid, gid = login_ids()
    passwd = _entries(Path("/etc/passwd"))
    group = _entries(Path("/etc/group"))
    passwd.append([LOGIN, "x", str(uid), str(gid), "NVIDIA", f"/home/{LOGIN}", "/bin/bash"])
    group.append([LOGIN, "x", str(gid), ""])
    names = {g[0] for g in group}
    for missing in (g for g in GROUPS if g not in names):
        group.append([missing, "x", str(_free_id(passwd, group)), ""])
    for entry in group:
        if entry[0] in GROUPS:
            members = [m for m in entry[3].split(",") if m]
            entry[3] = ",".join([*members, LOGIN])
    etc.mkdir(parents=True, exist_ok=True)
    _write(etc / "passwd", passwd, 0o644)
    _write(etc / "group", group, 0o644)
    # "*": no password can ever match, yet the account is not locked (sshd refuses locked ones).
    shadow = [*_entries(Path("/etc/shadow")), [LOGIN, "*", "20000", "0", "99999", "7", "", "", ""]]
    _write(etc / "shadow", shadow, 0o640)
    rules = {
        "all": [f"{LOGIN} ALL=(ALL) NOPASSWD: ALL"],
        "units": [
            f"{LOGIN} ALL=(root) NOPASSWD: "
            + ", ".join(
                f"{systemctl} {verb} {unit}"
                for unit in units
                for verb in ("stop", "disable --no-reload")
            )
        ],
        "none": [],
    }[sudo]
    sudoers = etc / "sudoers.d"
    sudoers.mkdir(mode=0o755, exist_ok=True)
    files = {"00-vrd-path": [f"Defaults secure_path={tools}:{path}"], "90-vrd-login": rules}
    for name, lines in files.items():
        if lines:
            rule = sudoers / name
            rule.write_text("\n".join(lines) + "\n")
            rule.chmod(0o440)
    own = home / LOGIN
    own.mkdir(parents=True, exist_ok=True)
    os.chown(own, uid, gid)
    own.chmod(0o750)


def _write(path: Path, entries: list[list[str]], mode: int) -> None:
    path.write_text("".join(":".join(e) + "\n" for e in entries))
    path.chmod(mode)
