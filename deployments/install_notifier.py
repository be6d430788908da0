"""Install the reboot notifier on a node over its SSH runner: idempotent, and says what changed.

Four files go to the node: the script, its systemd unit, its settings (notifier.env) and the
shared secret (notifier.secret, 0600, root's: the unit runs the script as a user of its own,
DynamicUser=, and systemd hands it the secret with LoadCredential=). Contents travel on
stdin, never on the command line, so the secret shows in no process list or log. A file is
written only when its sha256 or mode differs from what is there; the unit is reloaded only when
it changed, then enabled. What needs root is a fixed list of commands (``root_commands``), run
through ``sudo -n`` by a login that is not root: a sudoers line can allow exactly them, and the
install prints that line when sudo refuses one.
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from dataclasses import dataclass
from pathlib import Path

from vllm_redeploy import PROJECT
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import webhook_path
from vllm_redeploy.nodes import NodeAccess, NodeDocker, RemoteError, Runner
from vllm_redeploy.nodes.containers import LABEL_MANAGED
from vllm_redeploy.nodes.privilege import SUDOERS_FILE, probe_root, refused_as_root, sudoers_line

UNIT_NAME = "vllm-redeploy-notify.service"
SCRIPT_PATH = "usr/local/lib/vllm-redeploy/notify.py"
UNIT_PATH = f"etc/systemd/system/{UNIT_NAME}"
ENV_PATH = "etc/vllm-redeploy/notifier.env"
SECRET_PATH = "etc/vllm-redeploy/notifier.secret"  # noqa: S105 - a path, not a secret
SOURCE_DIR = Path(__file__).resolve().parent / "notifier"
COMMAND_TIMEOUT_S = 30.0

# One line per path argument, as the login sees it: "<octal mode> <sha256>", "<mode> -" when the
# login may not read it (the secret, 0600 root's: its digest is asked as root), or "missing".
_STATE = (
    'for f; do if [ ! -f "$f" ]; then echo missing; elif [ -r "$f" ]; then printf "%s %s\\n" '
    '"$(stat -c %a -- "$f")" "$(sha256sum < "$f" | cut -d" " -f1)"; else printf "%s -\\n" '
    '"$(stat -c %a -- "$f")"; fi; done'
)
# What runs as root, each command fixed so that a sudoers line can allow exactly it.
NOTIFIER_TOOLS = ("install", "sha256sum", "systemctl")


class NotifierInstallError(RemoteError):
    """The notifier could not be installed on a node (the message says why and what to do)."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (NotifierInstallError, (self.node, self.message))


@dataclass(frozen=True)
class NotifierFile:
    label: str
    path: str
    content: bytes
    mode: int


def _under(prefix: str, path: str) -> str:
    return posixpath.join(prefix or "/", path)


def notifier_files(
    config: ClusterConfig, node_name: str, prefix: str = "/", boot_id_file: str | None = None
) -> list[NotifierFile]:
    """What goes to the node: (label, path, content, mode) for each file, paths under ``prefix``.

    The paths inside notifier.env include ``prefix`` (the script runs on the node and reads them
    from there); the unit keeps its fixed ExecStart path.
    """
    if config.webhook.url is None:
        raise ValueError(
            "webhook.url is not set: set it in the [webhook] section of the configuration to the "
            "address at which the nodes reach the webhook service, e.g. http://controller:8787"
        )
    secret = config.secrets.webhook_secret
    if secret is None or not secret.get_secret_value():
        raise ValueError(
            "no webhook secret is configured: set VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET (the same "
            "value the webhook service uses) before installing the notifier"
        )
    if node_name not in {n.name for n in config.nodes}:
        names = ", ".join(n.name for n in config.nodes)
        raise ValueError(f"no node {node_name!r} in the configuration; nodes: {names}")
    secret_path = _under(prefix, SECRET_PATH)
    env_lines = [
        "# vllm-redeploy reboot notifier; written by `vllm-redeploy install-notifier`.",
        # The cluster's own path: a webhook that serves several clusters routes by it.
        f"URL={config.webhook.url.rstrip('/')}{webhook_path(config.name)}",
        f"NODE={node_name}",
        f"SECRET_FILE={secret_path}",
    ]
    if boot_id_file:
        env_lines.append(f"BOOT_ID_FILE={boot_id_file}")
    return [
        NotifierFile(
            "notify.py", _under(prefix, SCRIPT_PATH), (SOURCE_DIR / "notify.py").read_bytes(), 0o755
        ),
        NotifierFile(
            UNIT_NAME,
            _under(prefix, UNIT_PATH),
            (SOURCE_DIR / UNIT_NAME).read_bytes(),
            0o644,
        ),
        NotifierFile(
            "notifier.env", _under(prefix, ENV_PATH), "\n".join(env_lines).encode() + b"\n", 0o644
        ),
        NotifierFile(
            "notifier.secret", secret_path, secret.get_secret_value().encode() + b"\n", 0o600
        ),
    ]


def install_notifier(
    config: ClusterConfig,
    node_name: str,
    prefix: str = "/",
    *,
    enable: bool = True,
    boot_id_file: str | None = None,
    runner: Runner | None = None,
) -> list[str]:
    """Install (or bring up to date) the notifier on ``node_name``; one human line per step.

    ``prefix``: root under which the files go (test beds, chroots). ``enable=False`` only writes
    the files (an image build enables the unit itself). ``boot_id_file`` overrides where the
    script reads the boot id (default /proc/sys/kernel/random/boot_id). ``runner``: use this
    runner instead of opening the node's own (it is not closed).
    Raises ValueError for configuration problems, RemoteError when the node fails us.
    """
    if not prefix.startswith("/"):
        raise ValueError(f"prefix must be an absolute path on the node, got {prefix!r}")
    files = notifier_files(config, node_name, prefix, boot_id_file)
    if runner is not None:
        return _install(runner, files, enable)
    node = next(n for n in config.nodes if n.name == node_name)
    with NodeAccess(node, config) as access:
        return _install(access.runner, files, enable, reload_risk(access.docker))


def reload_risk(docker: NodeDocker) -> str | None:
    """Why reloading systemd on this node now would harm it, or None. Under Docker's systemd
    cgroup driver a `systemctl daemon-reload` takes the GPUs from running containers
    (nvidia-container-toolkit#48): never while a model of ours serves there."""
    driver = docker.cgroup_driver()
    if driver == "cgroupfs":
        return None
    serving = [c.name for c in docker.list_containers(labels={LABEL_MANAGED: PROJECT}) if c.running]
    if not serving:
        return None
    return (
        f"Docker there uses the {driver or 'unknown'} cgroup driver and {', '.join(serving)} "
        "run: a daemon-reload would take their GPUs (nvidia-container-toolkit#48)"
    )


def write_argv(file: NotifierFile) -> list[str]:
    """Write the file from stdin with its mode, its directories made (0755): one fixed command."""
    return ["install", "-D", "-m", f"{file.mode:04o}", "/dev/stdin", file.path]


def root_commands(files: list[NotifierFile], enable: bool) -> list[list[str]]:
    """Every command the install may run as root, for sudo -n or a sudoers line."""
    secret = next(f for f in files if f.label == "notifier.secret")
    commands = [["sha256sum", secret.path], *(write_argv(f) for f in files)]
    if enable:
        commands += [
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "--no-reload", UNIT_NAME],
        ]
    return commands


def file_states(runner: Runner, files: list[NotifierFile]) -> list[str]:
    """Each file as the node holds it: ``missing``, ``MODE DIGEST``, or ``MODE -`` when the
    login may not read it (the secret, to a login that is not root)."""
    state = runner.run(
        ["sh", "-c", _STATE, "sh", *(f.path for f in files)], timeout=COMMAND_TIMEOUT_S
    ).stdout.splitlines()
    if len(state) != len(files):
        raise NotifierInstallError(runner.node, f"unexpected answer checking files: {state!r}")
    return state


def _install(
    runner: Runner, files: list[NotifierFile], enable: bool, risk: str | None = None
) -> list[str]:
    root = probe_root(runner, NOTIFIER_TOOLS)
    commands = root_commands(files, enable)
    if (refused := refused_as_root(runner, root, commands)) is not None:
        shown = shlex.join(root.command(refused.commands[0]))
        raise NotifierInstallError(
            runner.node,
            f"{runner.node}: installing the notifier writes its files under /etc and /usr/local "
            f"and enables its unit, as root; the login {root.user} is not root and `sudo -n` "
            f"refuses `{shown}` ({refused.reason}). Allow exactly these commands there "
            f"(`sudo visudo -f {SUDOERS_FILE}`, beside the line preflight recommends) with the "
            f"line `{sudoers_line(root, commands)}`, or connect as root (ssh_user)",
        )
    lines = [] if root.is_root else ["using sudo -n (the SSH user is not root)"]

    def run(argv: list[str], stdin: bytes | None = None, check: bool = True) -> str:
        return runner.run(argv, stdin=stdin, check=check, timeout=COMMAND_TIMEOUT_S).stdout

    state = file_states(runner, files)
    unit_changed = False
    for file, now in zip(files, state, strict=True):
        want = hashlib.sha256(file.content).hexdigest()
        mode, _, digest = now.partition(" ")
        if digest == "-":  # the login may not read it: its digest as root
            digest = run(root.argv(["sha256sum", file.path])).partition(" ")[0]
        if now == "missing":
            how = "written (new)"
        elif digest != want:
            how = "written (changed)"
        elif int(mode, 8) != file.mode:
            how = f"written (mode {mode} -> {file.mode:o})"
        else:
            lines.append(f"{file.label}: unchanged")
            continue
        run(root.argv(write_argv(file)), stdin=file.content)
        lines.append(f"{file.label}: {how}")
        unit_changed |= file.label == UNIT_NAME
    if not enable:
        lines.append("unit not enabled (enable=False)")
        return lines
    if unit_changed and risk is None:
        run(root.argv(["systemctl", "daemon-reload"]))
        lines.append("systemd reloaded")
    elif unit_changed:
        lines.append(
            f"systemd NOT reloaded ({risk}); the notifier runs at boot, so it takes effect at "
            "the next boot; or run `systemctl daemon-reload` there while the group is down"
        )
    if run(["systemctl", "is-enabled", UNIT_NAME], check=False).strip() == "enabled":
        lines.append("unit already enabled")
    else:
        # --no-reload: `enable` would reload systemd itself otherwise (see reload_risk).
        run(root.argv(["systemctl", "enable", "--no-reload", UNIT_NAME]))
        lines.append("unit enabled")
    return lines
