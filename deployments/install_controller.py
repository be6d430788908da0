"""Install the controller's long-lived processes as systemd units: idempotent, says what changed.

Below ``prefix`` (default /), as root:

- the system user ``vllm-redeploy`` (``useradd --system``) when missing; the services run as it,
  and its home /var/lib/vllm-redeploy is their state directory (systemd makes it:
  ``StateDirectory=``), where its SSH key and known_hosts go;
- the unit files of ``deployments/systemd`` in /etc/systemd/system, their ExecStart= pointing at
  ``bin_dir`` (default: this installation's);
- /etc/vllm-redeploy/prefect.env, the Prefect server's settings, with a new API auth string;
- for a cluster: /etc/vllm-redeploy/<cluster>.toml (the given configuration, 0640) and
  <cluster>.env, a template naming its secrets plus the auth string its clients send.

The .env files are 0600 and the user's; once there they are the operator's: only their mode
and owner are repaired. Other files are rewritten when their content, mode or owner differ.
Nothing is reloaded or enabled unless ``enable``: then `systemctl daemon-reload` (when a unit
changed) and `systemctl enable` of the Prefect server and the cluster's units.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SERVICE_USER = "vllm-redeploy"
STATE_DIR = "/var/lib/vllm-redeploy"
UNIT_DIR = "etc/systemd/system"
CONF_DIR = "etc/vllm-redeploy"
SOURCE_DIR = Path(__file__).resolve().parent / "systemd"
SHIPPED_BIN_DIR = "/opt/vllm-redeploy/.venv/bin"  # what the shipped unit files name
PREFECT_UNIT = "vllm-redeploy-prefect.service"
CLUSTER_KINDS = ("serve", "webhook", "watch")
AUTH_SERVER = "PREFECT_SERVER_API_AUTH_STRING"
AUTH_CLIENT = "PREFECT_API_AUTH_STRING"
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
COMMAND_TIMEOUT_S = 60

Run = Callable[[list[str]], str]


class InstallError(Exception):
    """The controller could not be set up (the message says why and what to do)."""


@dataclass(frozen=True)
class Wanted:
    label: str
    path: Path
    content: bytes
    mode: int
    owner: Literal["root", "user", "group"]  # root:root, the user's, or root:the user's group
    operators: bool = False  # once there, only its mode and owner are ours


def unit_files(bin_dir: str) -> dict[str, str]:
    """The unit files (name -> text) with ExecStart= in ``bin_dir``."""
    return {
        path.name: path.read_text().replace(f"{SHIPPED_BIN_DIR}/", f"{bin_dir.rstrip('/')}/")
        for path in sorted(SOURCE_DIR.glob("*.service"))
    }


def cluster_units(cluster: str) -> list[str]:
    return [f"vllm-redeploy-{kind}@{cluster}.service" for kind in CLUSTER_KINDS]


def default_bin_dir() -> str:
    return str(Path(sys.executable).parent)


def read_env(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            values[key.strip()] = value.strip().strip("\"'")
    return values


def prefect_env() -> str:
    token = secrets.token_urlsafe(32)
    return "\n".join(
        [
            "# The Prefect server of vllm-redeploy (vllm-redeploy-prefect.service). Written",
            "# once by `vllm-redeploy install-controller`, yours from then on; mode 0600,",
            "# owner vllm-redeploy. Clients send the same string as PREFECT_API_AUTH_STRING.",
            f"{AUTH_SERVER}={SERVICE_USER}:{token}",
            "# PostgreSQL instead of SQLite (docs/operations.md):",
            "#PREFECT_SERVER_DATABASE_CONNECTION_URL="
            "postgresql+asyncpg://prefect:PASSWORD@127.0.0.1:5432/prefect",
            "# Serving other machines (browsers, workers): bind the LAN address.",
            "#PREFECT_SERVER_API_HOST=192.168.200.10",
            "#PREFECT_UI_API_URL=http://192.168.200.10:4200/api",
            "",
        ]
    )


def cluster_env(cluster: str, auth: str | None) -> str:
    auth_line = f"{AUTH_CLIENT}={auth}" if auth else f"#{AUTH_CLIENT}=user:password"
    return "\n".join(
        [
            f"# Secrets of cluster {cluster}'s services (vllm-redeploy-serve@{cluster},",
            f"# -webhook@{cluster}, -watch@{cluster}). Written once by `vllm-redeploy",
            "# install-controller`, yours from then on; mode 0600, owner vllm-redeploy.",
            "# The Prefect API (default: this machine's) and its auth string:",
            "#PREFECT_API_URL=http://127.0.0.1:4200/api",
            auth_line,
            "#VLLM_REDEPLOY_SECRETS__HF_TOKEN=hf_...",
            "# the webhook's: python3 -c 'import secrets; print(secrets.token_hex(32))'",
            "#VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET=",
            "#VLLM_REDEPLOY_SSH__KEY_PASSPHRASE=...",
            "",
        ]
    )


def _ids(root: Path) -> tuple[int, int] | None:
    """The service user's uid and gid in ``root``'s /etc/passwd, or None."""
    try:
        lines = (root / "etc/passwd").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == SERVICE_USER:
            return int(fields[2]), int(fields[3])
    return None


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise InstallError(f"`{argv[0]}` could not run: {why} (is it installed?)") from None
    except subprocess.TimeoutExpired:
        raise InstallError(f"`{' '.join(argv)}` did not end in {COMMAND_TIMEOUT_S} s") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise InstallError(f"`{' '.join(argv)}` failed: {why[-1] if why else done.returncode}")
    return done.stdout


def install_controller(
    prefix: str = "/",
    *,
    cluster: str | None = None,
    config_file: Path | None = None,
    bin_dir: str | None = None,
    enable: bool = False,
    run: Run = _run,
) -> list[str]:
    """Install (or bring up to date) the controller's units; one human line per step.

    ``config_file`` becomes /etc/vllm-redeploy/<cluster>.toml (``cluster`` is required with it;
    the caller checks that they agree). Raises InstallError; ValueError for bad arguments.
    """
    if not prefix.startswith("/"):
        raise ValueError(f"prefix must be an absolute path, got {prefix!r}")
    if cluster is not None and not CLUSTER_NAME.fullmatch(cluster):
        raise ValueError(f"cluster name {cluster!r}: letters, digits, '_', '.', '-' only")
    if config_file is not None and cluster is None:
        raise ValueError("a configuration needs its cluster's name")
    if os.geteuid() != 0:
        raise InstallError(
            "install-controller creates a system user and writes /etc: run it as root (sudo)"
        )
    root = Path(prefix)
    bin_dir = bin_dir or default_bin_dir()
    lines = _warnings(root, bin_dir)
    lines += _ensure_user(root, prefix, run)
    ids = _ids(root)
    if ids is None:
        raise InstallError(f"user {SERVICE_USER} is not in {root / 'etc/passwd'} after useradd")
    wanted = [
        Wanted(name, root / UNIT_DIR / name, text.encode(), 0o644, "root")
        for name, text in unit_files(bin_dir).items()
    ]
    conf = root / CONF_DIR
    wanted.append(
        Wanted("prefect.env", conf / "prefect.env", prefect_env().encode(), 0o600, "user", True)
    )
    changed = _apply(wanted, ids, lines)
    if cluster is not None:
        auth = read_env(conf / "prefect.env").get(AUTH_SERVER)
        mine = [Wanted(f"{cluster}.env", conf / f"{cluster}.env",
                       cluster_env(cluster, auth).encode(), 0o600, "user", True)]  # fmt: skip
        if config_file is not None:
            toml = config_file.read_bytes()
            mine.append(Wanted(f"{cluster}.toml", conf / f"{cluster}.toml", toml, 0o640, "group"))
        _apply(mine, ids, lines)
    units = [PREFECT_UNIT, *(cluster_units(cluster) if cluster else [])]
    if not enable:
        lines.append(
            "units not enabled (add --enable, or: systemctl daemon-reload && "
            f"systemctl enable --now {' '.join(units)})"
        )
        return lines
    lines += _enable(prefix, units, any(w.path.parent == root / UNIT_DIR for w in changed), run)
    return lines


def _warnings(root: Path, bin_dir: str) -> list[str]:
    lines = []
    if bin_dir.startswith(("/home/", "/root/")):
        lines.append(
            f"warning: {bin_dir} is under /home or /root, which the units hide (ProtectHome=yes): "
            "install into /opt/vllm-redeploy, or give --bin-dir"
        )
    for program in ("vllm-redeploy", "prefect"):
        if not os.access(root / bin_dir.lstrip("/") / program, os.X_OK):
            lines.append(f"warning: no {program} in {bin_dir} (the units' ExecStart=)")
    return lines


def _ensure_user(root: Path, prefix: str, run: Run) -> list[str]:
    if _ids(root) is not None:
        return [f"user {SERVICE_USER}: unchanged"]
    argv = ["useradd", "--system", "--user-group", "--home-dir", STATE_DIR, "--no-create-home",
            "--shell", "/usr/sbin/nologin", "--comment", "vllm-redeploy services"]  # fmt: skip
    if prefix != "/":
        argv += ["--prefix", prefix]
    run([*argv, SERVICE_USER])
    return [f"user {SERVICE_USER}: created (system user, home {STATE_DIR})"]


def _apply(wanted: list[Wanted], ids: tuple[int, int], lines: list[str]) -> list[Wanted]:
    """Write what differs; returns what was written or repaired."""
    changed = []
    for file in wanted:
        uid, gid = {"root": (0, 0), "user": ids, "group": (0, ids[1])}[file.owner]
        how = _difference(file, uid, gid)
        if how is None:
            lines.append(f"{file.label}: unchanged")
            continue
        if file.operators and file.path.exists():
            os.chown(file.path, uid, gid)
            os.chmod(file.path, file.mode)
        else:
            _write(file, uid, gid)
        lines.append(f"{file.label}: {how}")
        changed.append(file)
    return changed


def _difference(file: Wanted, uid: int, gid: int) -> str | None:
    try:
        stat = file.path.stat()
    except FileNotFoundError:
        return "written (new)"
    if not file.operators and file.path.read_bytes() != file.content:
        return "written (changed)"
    if stat.st_mode & 0o777 != file.mode:
        return f"mode {stat.st_mode & 0o777:o} -> {file.mode:o}"
    if (stat.st_uid, stat.st_gid) != (uid, gid):
        return f"owner {stat.st_uid}:{stat.st_gid} -> {uid}:{gid}"
    return None


def _write(file: Wanted, uid: int, gid: int) -> None:
    """Atomically, never readable by others on the way: created 0600, owned, then renamed."""
    file.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = file.path.with_name(f".{file.path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, file.content)
        os.fchown(fd, uid, gid)
        os.fchmod(fd, file.mode)
    finally:
        os.close(fd)
    tmp.replace(file.path)


def _enable(prefix: str, units: list[str], units_changed: bool, run: Run) -> list[str]:
    systemctl = ["systemctl"] if prefix == "/" else ["systemctl", f"--root={prefix}"]
    lines = []
    if prefix == "/" and units_changed:
        run(["systemctl", "daemon-reload"])
        lines.append("systemd reloaded")
    for unit in units:
        state = _is_enabled(systemctl, unit, run)
        if state == "enabled":
            lines.append(f"{unit}: already enabled")
            continue
        run([*systemctl, "enable", "--no-reload", unit])
        lines.append(f"{unit}: enabled")
    return lines


def _is_enabled(systemctl: list[str], unit: str, run: Run) -> str:
    try:
        return run([*systemctl, "is-enabled", unit]).strip()
    except InstallError:
        return "disabled"  # is-enabled exits 1 for disabled units
