"""Install the controller's long-lived processes as systemd units: idempotent, says what changed.

Below ``prefix`` (default /), as root:

- the system users ``vllm-redeploy`` and ``vllm-redeploy-webhook`` (``useradd --system``) when
  missing. The Prefect server, ``serve`` and the watcher run as the first; its home
  /var/lib/vllm-redeploy is their state directory (systemd makes it: ``StateDirectory=``), where
  the SSH key and known_hosts go. The webhook, the one service the network reaches, runs as the
  second, and holds no Prefect credential: it keeps each accepted notice in
  /var/lib/vllm-redeploy-spool (the webhook's user and the services' group, 2770), which the
  cluster's watcher reads and posts;
- the unit files of ``deployments/systemd`` in /etc/systemd/system, their ExecStart= pointing at
  ``bin_dir`` (default: this installation's);
- /etc/vllm-redeploy/prefect.env, the Prefect server's settings, with a new API auth string;
- for a cluster: /etc/vllm-redeploy/<cluster>.toml (the given configuration) and <cluster>.env,
  a template naming its secrets plus the auth string its clients send: what ``serve`` (and an
  operator's ``vllm-redeploy run``) reads;
- each narrower service's part of those two, derived from them on every run: the watcher's
  <cluster>.watch.toml and .watch.env (everything but the ``[secrets]``: no HF token, no webhook
  secret) and the webhook's <cluster>.webhook.toml and .webhook.env (its secret and its settings
  only; no Prefect credential, SSH key, passphrase or HF token). The loader reads the env file
  beside a TOML, so each service, started with its own TOML, reads its own env file only.

Every file is root's, readable by its service's group only (0640), so no service can rewrite
what it runs with. prefect.env and <cluster>.env are the operator's once there: only their mode
and owner are repaired. Other files are rewritten when their content, mode or owner differ.
Nothing is reloaded or enabled unless ``enable``: then `systemctl daemon-reload` (when a unit
changed) and `systemctl enable` of the Prefect server and the cluster's units.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dotenv import dotenv_values

from deployments import service_ssh
from vllm_redeploy.config.toml_text import toml_document

SERVICE_USER = service_ssh.SERVICE_USER
STATE_DIR = service_ssh.HOME
# The webhook's own user; its home is never made (it keeps nothing but the spool).
WEBHOOK_USER = "vllm-redeploy-webhook"
WEBHOOK_STATE_DIR = "/var/lib/vllm-redeploy-webhook"
# Where the webhook keeps accepted notices and the watchers take them from (the units name it).
SPOOL_DIR = "/var/lib/vllm-redeploy-spool"
SPOOL_MODE = 0o2770  # the webhook writes, the services' group reads and removes; new files and
# directories get that group (setgid)
UNIT_DIR = "etc/systemd/system"
CONF_DIR = "etc/vllm-redeploy"
SOURCE_DIR = Path(__file__).resolve().parent / "systemd"
SHIPPED_BIN_DIR = "/opt/vllm-redeploy/.venv/bin"  # what the shipped unit files name
PREFECT_UNIT = "vllm-redeploy-prefect.service"
CLUSTER_KINDS = ("serve", "webhook", "watch")
AUTH_SERVER = "PREFECT_SERVER_API_AUTH_STRING"
AUTH_CLIENT = "PREFECT_API_AUTH_STRING"
WEBHOOK_SECRET_ENV = "VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET"  # noqa: S105 - a variable name
SECRETS_PREFIX = "VLLM_REDEPLOY_SECRETS"  # the [secrets] table, key by key or as JSON
# What the webhook's env file keeps of the cluster's: its shared secret and its own settings,
# never Prefect's API settings (the auth string is Prefect's whole admin credential).
WEBHOOK_ENV_PREFIXES = (WEBHOOK_SECRET_ENV, "VLLM_REDEPLOY_WEBHOOK__")
# The [secrets] each narrower service uses (an allow-list: a new secret reaches neither until
# it is named here). The watcher's looks and generations send vLLM's API key.
SERVICE_SECRETS = {"watch": ("vllm_api_key",), "webhook": ("webhook_secret",)}
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
    # root:root, or root and the group of the services' user or of the webhook's
    owner: Literal["root", "group", "webhook"]
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
            "# once by `vllm-redeploy install-controller`, yours from then on; mode 0640,",
            "# root:vllm-redeploy. Clients send the same string as PREFECT_API_AUTH_STRING.",
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
            f"# Secrets of cluster {cluster} (vllm-redeploy-serve@{cluster} reads them all).",
            "# Written once by `vllm-redeploy install-controller`, yours from then on; mode 0640,",
            "# root:vllm-redeploy. After an edit run install-controller again: it gives the",
            f"# watcher ({cluster}.watch.env: all but the [secrets]) and the webhook",
            f"# ({cluster}.webhook.env: the webhook secret alone, no Prefect credential) theirs.",
            "# The Prefect API (default: this machine's) and its auth string:",
            "#PREFECT_API_URL=http://127.0.0.1:4200/api",
            auth_line,
            "#VLLM_REDEPLOY_SECRETS__HF_TOKEN=hf_...",
            "# the webhook's: python3 -c 'import secrets; print(secrets.token_hex(32))'",
            "#VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET=",
            "#VLLM_REDEPLOY_SSH__KEY_PASSPHRASE=...",
            "#VLLM_REDEPLOY_SECRETS__VLLM_API_KEY=...",
            "",
        ]
    )


def derived_env(text: str, service: Literal["watch", "webhook"]) -> str:
    """The lines of the cluster's env file ``text`` that ``service`` gets, as they are written
    there: the watcher all but the ``[secrets]`` it does not use (the HF token, the webhook
    secret), the webhook only its secret and its settings."""
    own = tuple(f"{SECRETS_PREFIX}__{name}".upper() for name in SERVICE_SECRETS["watch"])
    kept = []
    for raw in text.splitlines():
        line = raw.strip()
        key = line.partition("=")[0].strip().removeprefix("export ").strip().upper()
        if not line or line.startswith("#") or "=" not in line:
            continue
        if key == SECRETS_PREFIX:  # the whole table as JSON: the service's own, key by key
            kept += _own_secrets(line, service)
            continue
        wanted = (
            key.startswith(WEBHOOK_ENV_PREFIXES)
            if service == "webhook"
            else not key.startswith(SECRETS_PREFIX) or key in own
        )
        if wanted:
            kept.append(line)
    head = [
        f"# The {service} service's part of this cluster's env file, written by `vllm-redeploy",
        "# install-controller` on every run: edit the cluster's .env, then run it again.",
    ]
    return "\n".join([*head, *kept, ""])


def _own_secrets(line: str, service: Literal["watch", "webhook"]) -> list[str]:
    """Of a ``VLLM_REDEPLOY_SECRETS=<JSON>`` line, the secrets ``service`` uses, one variable
    each (``VLLM_REDEPLOY_SECRETS__NAME="..."``): the JSON whole would hand it all of them."""
    value = dotenv_values(stream=io.StringIO(line)).get(SECRETS_PREFIX) or ""
    try:
        table = json.loads(value)
    except ValueError:
        return []  # the loader says what is wrong with it, where the cluster's env is read
    if not isinstance(table, dict):
        return []
    return [
        f"{SECRETS_PREFIX}__{name.upper()}={json.dumps(str(table[name]))}"
        for name in SERVICE_SECRETS[service]
        if table.get(name)
    ]


def derived_toml(data: dict[str, Any], service: Literal["watch", "webhook"]) -> str:
    """The cluster's configuration as ``service`` reads it: of the ``[secrets]`` only those it
    uses (SERVICE_SECRETS). The webhook's names neither the SSH keys, their passphrase nor the
    containers' environment: what it cannot read it must not name (the loader checks that a key
    file it names exists)."""
    secrets_table = _table(data, "secrets") or {}
    data = {k: v for k, v in data.items() if k != "secrets"}
    kept = {k: v for k, v in secrets_table.items() if k in SERVICE_SECRETS[service]}
    if kept:
        data["secrets"] = kept
    if service == "webhook":
        ssh = _table(data, "ssh")
        if ssh is not None:
            data["ssh"] = {k: v for k, v in ssh.items() if k not in ("key_file", "key_passphrase")}
        if isinstance(data.get("nodes"), list):
            data["nodes"] = [
                {k: v for k, v in n.items() if k != "ssh_key_file"} if isinstance(n, dict) else n
                for n in data["nodes"]
            ]
        vllm = _table(data, "vllm")
        if vllm is not None:
            data["vllm"] = {k: v for k, v in vllm.items() if k != "env"}
    head = [
        f"# The {service} service's view of this cluster's configuration, written by",
        "# `vllm-redeploy install-controller` on every run from the cluster's .toml: edit that",
        "# (or the file given with -c), then run it again.",
    ]
    return "\n".join([*head, *toml_document(data), ""])


def _table(data: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = data.get(key)
    return value if isinstance(value, dict) else None


def _cluster_data(toml: Path | None) -> dict[str, Any] | None:
    """The cluster file to be installed (or the one installed), parsed; None when there is none."""
    if toml is None or not toml.exists():
        return None
    try:
        return tomllib.loads(toml.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InstallError(f"{toml}: not valid TOML ({exc}); fix it or give --config") from None


def _ids(root: Path, user: str = SERVICE_USER) -> tuple[int, int] | None:
    """``user``'s uid and gid in ``root``'s /etc/passwd, or None."""
    try:
        lines = (root / "etc/passwd").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == user:
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
    if hidden := _hidden_from_units(bin_dir):
        raise InstallError(hidden)
    conf = root / CONF_DIR
    data = _cluster_data(config_file or (conf / f"{cluster}.toml" if cluster else None))
    if data is not None and (unseen := service_ssh.unseen(data)):
        raise InstallError(unseen)
    bin_dir = bin_dir or default_bin_dir()
    lines = _warnings(root, bin_dir)
    lines += _ensure_user(root, prefix, run, SERVICE_USER, STATE_DIR, "vllm-redeploy services")
    lines += _ensure_user(
        root, prefix, run, WEBHOOK_USER, WEBHOOK_STATE_DIR, "vllm-redeploy reboot webhook"
    )
    groups = {}
    for user in (SERVICE_USER, WEBHOOK_USER):
        ids = _ids(root, user)
        if ids is None:
            raise InstallError(f"user {user} is not in {root / 'etc/passwd'} after useradd")
        groups[user] = ids[1]
    lines += service_ssh.make_dir(root, *(_ids(root) or (0, 0)))
    lines += _spool_dir(root, _ids(root, WEBHOOK_USER) or (0, 0), groups[SERVICE_USER])
    wanted = [
        Wanted(name, root / UNIT_DIR / name, text.encode(), 0o644, "root")
        for name, text in unit_files(bin_dir).items()
    ]
    wanted.append(
        Wanted("prefect.env", conf / "prefect.env", prefect_env().encode(), 0o640, "group", True)
    )
    changed = _apply(wanted, groups, lines)
    if cluster is not None:
        auth = read_env(conf / "prefect.env").get(AUTH_SERVER)
        mine = [Wanted(f"{cluster}.env", conf / f"{cluster}.env",
                       cluster_env(cluster, auth).encode(), 0o640, "group", True)]  # fmt: skip
        if config_file is not None:
            toml = config_file.read_bytes()
            mine.append(Wanted(f"{cluster}.toml", conf / f"{cluster}.toml", toml, 0o640, "group"))
        _apply(mine, groups, lines)
        _apply(_derived(conf, cluster, lines), groups, lines)
        if not read_env(conf / f"{cluster}.env").get(WEBHOOK_SECRET_ENV):
            lines.append(
                f"note: {cluster}.env sets no {WEBHOOK_SECRET_ENV}: the webhook refuses to start "
                "until it does (set it there, then run install-controller again)"
            )
        if data is not None:
            lines += service_ssh.missing(root, data)
    units = [PREFECT_UNIT, *(cluster_units(cluster) if cluster else [])]
    if not enable:
        lines.append(
            "units not enabled (add --enable, or: systemctl daemon-reload && "
            f"systemctl enable --now {' '.join(units)})"
        )
        return lines
    lines += _enable(prefix, units, any(w.path.parent == root / UNIT_DIR for w in changed), run)
    return lines


INSTALL_RECIPE = (
    "sudo python3 -m venv /opt/vllm-redeploy/.venv && sudo /opt/vllm-redeploy/.venv/bin/pip "
    "install ./vllm-redeploy  (a checkout or wheel; not -e), then sudo "
    "/opt/vllm-redeploy/.venv/bin/vllm-redeploy install-controller ..."
)


def _hidden_from_units(bin_dir: str | None) -> str | None:
    """Why the units could not run this installation: its programs (``bin_dir``, default this
    one's) or, for this one, its code (an editable or user install) under a path the units
    hide. Nothing is written for an installation that could not start."""
    found = [("the units' programs", bin_dir or default_bin_dir())]
    if bin_dir is None:
        import vllm_redeploy

        found.append(("its code", str(Path(vllm_redeploy.__file__).resolve().parent)))
    for what, path in found:
        if (path.rstrip("/") + "/").startswith(service_ssh.HIDDEN):
            return (
                f"install-controller: {what} ({path}) are under /home, /root or /run/user, which "
                "the units hide (ProtectHome=yes): the services could not start, so nothing was "
                "installed. Install into a root-owned virtual environment they see: "
                f"{INSTALL_RECIPE}"
            )
    return None


def _spool_dir(root: Path, webhook: tuple[int, int], group: int) -> list[str]:
    """The spool's base: the webhook's, the services' group's, 2770."""
    path = root / SPOOL_DIR.lstrip("/")
    how = "unchanged"
    if not path.is_dir():
        path.mkdir(parents=True)
        how = "made"
    stat = path.stat()
    if (stat.st_uid, stat.st_gid, stat.st_mode & 0o7777) != (webhook[0], group, SPOOL_MODE):
        os.chown(path, webhook[0], group)
        path.chmod(SPOOL_MODE)
        how = "made" if how == "made" else "repaired"
    if how == "unchanged":
        return [f"{SPOOL_DIR}: unchanged"]
    return [
        f"{SPOOL_DIR}: {how} ({SPOOL_MODE:04o}, {WEBHOOK_USER}:{SERVICE_USER}: the webhook keeps "
        "accepted notices there, the watcher posts them)"
    ]


def _warnings(root: Path, bin_dir: str) -> list[str]:
    lines = []
    for program in ("vllm-redeploy", "prefect"):
        if not os.access(root / bin_dir.lstrip("/") / program, os.X_OK):
            lines.append(f"warning: no {program} in {bin_dir} (the units' ExecStart=)")
    return lines


def _ensure_user(
    root: Path, prefix: str, run: Run, user: str, home: str, comment: str
) -> list[str]:
    if _ids(root, user) is not None:
        return [f"user {user}: unchanged"]
    argv = ["useradd", "--system", "--user-group", "--home-dir", home, "--no-create-home",
            "--shell", "/usr/sbin/nologin", "--comment", comment]  # fmt: skip
    if prefix != "/":
        argv += ["--prefix", prefix]
    run([*argv, user])
    return [f"user {user}: created (system user, home {home})"]


def _derived(conf: Path, cluster: str, lines: list[str]) -> list[Wanted]:
    """The watcher's and the webhook's files, from the cluster's .toml (when there) and .env."""
    wanted = []
    toml = conf / f"{cluster}.toml"
    if toml.exists():
        try:
            data = tomllib.loads(toml.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InstallError(f"{toml}: not valid TOML ({exc}); fix it or give --config") from None
        for service, owner in (("watch", "group"), ("webhook", "webhook")):
            text = derived_toml(data, service)  # type: ignore[arg-type]
            name = f"{cluster}.{service}.toml"
            wanted.append(Wanted(name, conf / name, text.encode(), 0o640, owner))  # type: ignore[arg-type]
    else:
        lines.append(
            f"{cluster}.watch.toml, {cluster}.webhook.toml: not written (no {cluster}.toml: "
            "give --config)"
        )
    env = (conf / f"{cluster}.env").read_text(encoding="utf-8", errors="replace")
    for service, owner in (("watch", "group"), ("webhook", "webhook")):
        name = f"{cluster}.{service}.env"
        text = derived_env(env, service)  # type: ignore[arg-type]
        wanted.append(Wanted(name, conf / name, text.encode(), 0o640, owner))  # type: ignore[arg-type]
    return wanted


def _apply(wanted: list[Wanted], groups: dict[str, int], lines: list[str]) -> list[Wanted]:
    """Write what differs; returns what was written or repaired. ``groups``: each user's gid."""
    changed = []
    gids = {"root": 0, "group": groups[SERVICE_USER], "webhook": groups[WEBHOOK_USER]}
    for file in wanted:
        uid, gid = 0, gids[file.owner]
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


def write_webhook_config(source: Path, target: Path) -> None:
    """The webhook's view of the configuration ``source`` (derived_toml) into ``target``: for a
    webhook that runs where the SSH keys are not, as compose.yaml's does."""
    data = tomllib.loads(source.read_text(encoding="utf-8"))
    target.write_text(derived_toml(data, "webhook"), encoding="utf-8")


if __name__ == "__main__":
    # python -m deployments.install_controller --webhook-config SOURCE TARGET (compose.yaml)
    if len(sys.argv) != 4 or sys.argv[1] != "--webhook-config":
        sys.exit("usage: python -m deployments.install_controller --webhook-config SOURCE TARGET")
    try:
        write_webhook_config(Path(sys.argv[2]), Path(sys.argv[3]))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        sys.exit(f"{sys.argv[2]}: {exc}")
