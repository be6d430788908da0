"""The node notifier: installed over SSH onto a test-bed node at the real paths (the node's own
/etc and /usr/local), by the README's command; run by the node's systemd (the bed's systemctl
stand-in, from the unit file installed) after a real bed reboot, against the real webhook and
Prefect server; and its retry rules against a webhook that is down, or that refuses."""

from __future__ import annotations

import contextlib
import hmac
import http.server
import os
import re
import secrets
import select
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.event_sender import EventSender, reboot_event_id
from deployments.install_notifier import (
    ENV_PATH,
    NOTIFIER_TOOLS,
    SCRIPT_PATH,
    SECRET_PATH,
    UNIT_NAME,
    UNIT_PATH,
    NotifierInstallError,
    install_notifier,
    notifier_files,
    reload_risk,
    root_commands,
)
from deployments.webhook import SECRET_ENV, running_webhook, sign
from tests.conftest import keep_for_notes
from tests.test_webhook import make_config, wait_for_event
from tests.testbed import users
from tests.testbed.bed import TestBed
from tests.testbed.node import EmulatedNode
from tests.testbed.procs import free_port, wait_until
from tests.testbed.standins.units import parse_ini
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.nodes import NodeAccess, SSHRunner, runner_for
from vllm_redeploy.nodes.privilege import probe_root, refused_as_root
from vllm_redeploy.nodes.runner import OutputCapture

pytestmark = pytest.mark.integration

NODE = "node-2"
# Where the test puts the line install-notifier asks for, as the operator would (visudo -f).
SUDO_LINE = "/etc/sudoers.d/50-notifier-install"
SUDO_PREFIX_LINE = "/etc/sudoers.d/51-notifier-prefix"
SCRIPT = Path(__file__).resolve().parents[1] / "deployments" / "notifier" / "notify.py"
PYTHON = "/usr/bin/python3"  # what the unit's ExecStart runs


@dataclass
class Setup:
    bed: TestBed
    node: EmulatedNode
    config: ClusterConfig
    config_path: Path
    secret: str
    api: str
    sender: EventSender

    def read(self, relative: str) -> str:
        """A file as the node sees it (its own /etc, /usr/local)."""
        done = self.node.run(["cat", f"/{relative}"])
        assert done.returncode == 0, done.stderr
        return done.stdout

    def mode(self, relative: str) -> int:
        return int(self.node.run(["stat", "-c", "%a", f"/{relative}"]).stdout, 8)


class RecordingRunner(SSHRunner):
    """The real SSH runner, keeping what each command was given."""

    def __init__(self, base: SSHRunner) -> None:
        super().__init__(base.node, base.target, base.secrets)
        self.calls: list[tuple[tuple[str, ...], dict[str, str], bytes | None]] = []

    def _execute(
        self,
        argv: tuple[str, ...],
        *,
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,
        capture: OutputCapture,
    ) -> tuple[int | None, bool]:
        self.calls.append((argv, dict(env), stdin))
        return super()._execute(argv, env=env, stdin=stdin, timeout=timeout, capture=capture)


def _clean(node: EmulatedNode) -> None:
    """Nothing of the notifier left on the node: its unit off and gone, its files removed."""
    node.systemctl("disable", "--now", UNIT_NAME)
    node.run(["rm", "-rf", "/etc/vllm-redeploy", "/usr/local/lib/vllm-redeploy", f"/{UNIT_PATH}"])
    node.run(["rm", "-f", SUDO_LINE, SUDO_PREFIX_LINE])
    node.systemctl("daemon-reload")


@pytest.fixture(scope="module")
def setup(
    bed: TestBed, prefect_api: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    secret = secrets.token_hex(32)
    port = free_port("127.0.0.1")
    path = tmp_path_factory.mktemp("notifier") / "cluster.toml"
    bed.write_config(
        path,
        name=f"nt{uuid.uuid4().hex[:8]}",  # type: ignore[arg-type]
        webhook={"url": f"http://127.0.0.1:{port}"},
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SECRET_ENV, secret)  # as an operator would; never in a file
        config = load_config(path, env_file=None)
    assert secret not in path.read_text()
    node = bed.node(NODE)
    _clean(node)
    # The bed's node-2 login has sudo for the old stack's unit only (the line preflight
    # recommends): installing asks for its own commands (allow_what_it_asks).
    sender = EventSender(prefect_api)
    try:
        with running_webhook(config, sender, port=port):
            yield Setup(bed, node, config, path, secret, prefect_api, sender)
    finally:
        sender.close(timeout=10)
        _clean(node)


def asked_line(message: str) -> str:
    found = re.search(r"with the line `([^`]+)`", message)
    assert found, message
    return found.group(1)


def allow_what_it_asks(setup: Setup, prefix: str = "/", enable: bool = True) -> None:
    """The sudoers line install-notifier prints when sudo refuses it, put on the node."""
    node_config = next(n for n in setup.config.nodes if n.name == NODE)
    files = notifier_files(setup.config, NODE, prefix)
    with runner_for(node_config, setup.config) as runner:
        root = probe_root(runner, NOTIFIER_TOOLS)
        if refused_as_root(runner, root, root_commands(files, enable)) is None:
            return
    with pytest.raises(NotifierInstallError) as refused:
        install_notifier(setup.config, NODE, prefix, enable=enable)
    where = SUDO_LINE if prefix == "/" else SUDO_PREFIX_LINE
    setup.node.write_file(where, asked_line(refused.value.message) + "\n", mode=0o440)


def run_install_command(setup: Setup) -> subprocess.CompletedProcess[str]:
    """`vllm-redeploy install-notifier NODE` as the README has it, in the directory of the
    cluster's cluster.toml with the secret in the environment."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "vllm-redeploy"), "install-notifier", NODE],
        cwd=setup.config_path.parent,
        env={**os.environ, SECRET_ENV: setup.secret},
        capture_output=True,
        text=True,
        timeout=120,
    )


def install_command(setup: Setup) -> list[str]:
    """The install, which must succeed: its output lines."""
    done = run_install_command(setup)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_sudo_refusing_the_install_prints_the_exact_line_that_allows_it(setup: Setup) -> None:
    """As on a Spark whose login has password sudo, with the line preflight recommends for the
    old stack's unit: the install is refused before any file is written, naming the line; with
    that line (and nothing more) in sudoers, it installs."""
    setup.node.run(["rm", "-f", SUDO_LINE])
    done = run_install_command(setup)
    assert done.returncode == 1, done.stdout + done.stderr
    keep_for_notes("notifier-sudo-refused", done.stderr)
    assert done.stderr.count("\n") == 1  # one line, never wrapped: the sudoers line is copied
    message = done.stderr.strip()
    assert message.startswith(f"{NODE}: installing the notifier writes its files"), message
    assert "Traceback" not in done.stderr and setup.secret not in done.stderr
    line = asked_line(message)
    assert line.startswith(f"{users.LOGIN} ALL=(root) NOPASSWD: ")
    assert f"install -D -m 0600 /dev/stdin /{SECRET_PATH}," in line
    assert line.endswith(f"systemctl enable --no-reload {UNIT_NAME}")
    assert setup.node.run(["test", "-e", f"/{SECRET_PATH}"]).returncode == 1  # nothing written
    setup.node.write_file(SUDO_LINE, line + "\n", mode=0o440)
    assert install_command(setup)[-1] in ("unit enabled", "unit already enabled")
    _clean(setup.node)


def test_install_is_idempotent_and_keeps_the_secret_off_argv(setup: Setup) -> None:
    allow_what_it_asks(setup)
    node_config = next(n for n in setup.config.nodes if n.name == NODE)
    runner = RecordingRunner(runner_for(node_config, setup.config))  # type: ignore[arg-type]
    with runner:
        first = install_notifier(setup.config, NODE, runner=runner)
    assert first == [
        "using sudo -n (the SSH user is not root)",  # the login is nvidia, as on a Spark
        "notify.py: written (new)",
        f"{UNIT_NAME}: written (new)",
        "notifier.env: written (new)",
        "notifier.secret: written (new)",
        "systemd reloaded",
        "unit enabled",
    ]
    node = setup.node
    assert node.systemctl("is-enabled", UNIT_NAME).stdout == "enabled\n"
    loaded = node.systemctl("show", "-p", "LoadState,UnitFileState,FragmentPath", UNIT_NAME)
    assert loaded.stdout.split() == [
        "LoadState=loaded",
        "UnitFileState=enabled",
        f"FragmentPath=/{UNIT_PATH}",
    ]
    assert setup.read(SCRIPT_PATH) == SCRIPT.read_text()
    assert setup.read(UNIT_PATH) == (SCRIPT.parent / UNIT_NAME).read_text()
    modes = {p: setup.mode(p) for p in (SCRIPT_PATH, ENV_PATH, SECRET_PATH)}
    assert modes == {SCRIPT_PATH: 0o755, ENV_PATH: 0o644, SECRET_PATH: 0o600}
    assert setup.read(SECRET_PATH) == setup.secret + "\n"
    env_file = setup.read(ENV_PATH)
    # The webhook's address (the path under it is the reboot test's to prove).
    assert f"\nURL={setup.config.webhook.url}" in env_file
    assert f"NODE={NODE}\n" in env_file
    assert f"SECRET_FILE=/{SECRET_PATH}\n" in env_file
    assert setup.secret not in env_file
    # The secret went to the node on stdin once, and never on a command line or in env.
    secret = setup.secret.encode()
    assert all(setup.secret not in " ".join(argv) for argv, _, _ in runner.calls)
    assert all(setup.secret not in " ".join(env.values()) for _, env, _ in runner.calls)
    assert sum(secret in (stdin or b"") for _, _, stdin in runner.calls) == 1

    assert install_command(setup) == [
        "using sudo -n (the SSH user is not root)",
        "notify.py: unchanged",
        f"{UNIT_NAME}: unchanged",
        "notifier.env: unchanged",
        "notifier.secret: unchanged",
        "unit already enabled",
    ]

    # Drift on the node is repaired, and only it.
    node.run(["sh", "-c", f"echo MAX_WAIT_S=5 >> /{ENV_PATH} && chmod 644 /{SECRET_PATH}"])
    third = install_notifier(setup.config, NODE)
    assert third == [
        "using sudo -n (the SSH user is not root)",
        "notify.py: unchanged",
        f"{UNIT_NAME}: unchanged",
        "notifier.env: written (changed)",
        "notifier.secret: written (mode 644 -> 600)",
        "unit already enabled",
    ]
    assert setup.mode(SECRET_PATH) == 0o600


def test_install_below_a_prefix_writes_an_image_root_only(setup: Setup, tmp_path: Path) -> None:
    """For chroots and image builds: every file below the prefix, nothing enabled."""
    allow_what_it_asks(setup, str(tmp_path), enable=False)
    lines = install_notifier(setup.config, NODE, str(tmp_path), enable=False)
    assert lines[-1] == "unit not enabled (enable=False)"
    assert (tmp_path / UNIT_PATH).read_bytes() == (SCRIPT.parent / UNIT_NAME).read_bytes()
    assert (tmp_path / SECRET_PATH).stat().st_mode & 0o777 == 0o600
    assert f"SECRET_FILE={tmp_path / SECRET_PATH}\n" in (tmp_path / ENV_PATH).read_text()


def test_install_needs_the_webhook_url_and_secret(setup: Setup) -> None:
    no_url = make_config("x", "s" * 32)
    with pytest.raises(ValueError, match=r"webhook\.url"):
        install_notifier(no_url, "node-1")
    no_secret = make_config("x", None, url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match=SECRET_ENV):
        install_notifier(no_secret, "node-1")
    with pytest.raises(ValueError, match="no node 'node-7'"):
        install_notifier(make_config("x", "s" * 32, url="http://127.0.0.1:9"), "node-7")


def test_a_reboot_runs_the_installed_notifier_and_its_event_reaches_prefect(
    setup: Setup,
) -> None:
    allow_what_it_asks(setup)
    assert install_command(setup)[-1] in ("unit already enabled", "unit enabled")
    node = setup.node
    old_boot = node.boot_id_file.read_text().strip()
    setup.bed.reboot(NODE)
    boot_id = node.boot_id_file.read_text().strip()
    assert boot_id != old_boot
    assert node.run(["cat", "/proc/sys/kernel/random/boot_id"]).stdout.strip() == boot_id

    # The node's systemd started the enabled unit at boot; nothing else ran the script.
    event_id = reboot_event_id(setup.config.name, NODE, boot_id)
    event = wait_for_event(setup.api, setup.config.name, event_id)
    assert event["resource"]["vllm-redeploy.node"] == NODE
    assert event["payload"]["boot_id"] == boot_id
    assert event["payload"]["uptime_s"] > 0
    wait_until(
        lambda: node.systemctl("show", "-p", "SubState", "--value", UNIT_NAME).stdout == "exited\n",
        20,
        "the notifier's unit: active (exited)",
    )
    assert node.systemctl("is-active", UNIT_NAME).stdout == "active\n"
    node_config = next(n for n in setup.config.nodes if n.name == NODE)
    with runner_for(node_config, setup.config) as runner:  # what an operator reads, over SSH
        logs = runner.run(["journalctl", "-u", "vllm-redeploy-notify", "-b"], timeout=30).stdout
    assert "202 accepted" in logs and "Started vllm-redeploy-notify.service" in logs
    assert setup.secret not in logs


def _notifier(
    tmp_path: Path, secret: str, url: str, node: str = "node-1", max_wait_s: float = 30
) -> tuple[list[str], dict[str, str], str]:
    """argv and environment to run notify.py here, with its own env, secret and boot id files."""
    secret_file = tmp_path / "notifier.secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    boot_id = str(uuid.uuid4())
    (tmp_path / "boot_id").write_text(boot_id + "\n")
    env_file = tmp_path / "notifier.env"
    env_file.write_text(
        f"URL={url}\nNODE={node}\nSECRET_FILE={secret_file}\n"
        f"BOOT_ID_FILE={tmp_path / 'boot_id'}\nMAX_WAIT_S={max_wait_s}\n"
    )
    env = {"PATH": os.environ["PATH"], "VRD_NOTIFIER_ENV": str(env_file)}
    return [PYTHON, str(SCRIPT)], env, boot_id


def test_notifier_retries_until_the_webhook_comes_up(setup: Setup, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    argv, env, boot_id = _notifier(tmp_path, setup.secret, f"http://127.0.0.1:{port}")
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, bufsize=0)
    try:
        # The webhook comes up only once the notifier has failed twice (nothing listening).
        early = [_line(proc), _line(proc)]
        with running_webhook(setup.config, setup.sender, port=port):
            _, rest = proc.communicate(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    attempts = early + rest.decode().splitlines()
    assert proc.returncode == 0, attempts
    assert all("retrying in" in line for line in attempts[:2]), attempts
    assert "202 accepted" in attempts[-1], attempts
    wait_for_event(
        setup.api, setup.config.name, reboot_event_id(setup.config.name, "node-1", boot_id)
    )


def _line(proc: subprocess.Popen[bytes], timeout: float = 20) -> str:
    """The next line the notifier writes on stderr (one per attempt)."""
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    assert ready, f"the notifier wrote nothing for {timeout:g} s"
    return proc.stderr.readline().decode()


def test_notifier_gives_up_at_once_when_refused(setup: Setup, tmp_path: Path) -> None:
    argv, env, _ = _notifier(tmp_path, setup.secret, str(setup.config.webhook.url), node="node-9")
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 3
    assert len(proc.stderr.splitlines()) == 1 and "HTTP 400" in proc.stderr


def test_notifier_retries_401_then_gives_up_after_max_wait(setup: Setup, tmp_path: Path) -> None:
    argv, env, _ = _notifier(
        tmp_path, "not-the-secret-" * 4, str(setup.config.webhook.url), max_wait_s=2
    )
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert 1.5 < time.monotonic() - started < 6
    lines = proc.stderr.splitlines()
    assert len(lines) >= 2 and all("HTTP 401" in line for line in lines)
    assert "not-the-secret" not in proc.stderr


# --- no daemon-reload behind a serving model (issue 14) ---------------------------------------


class _Engine:
    """What reload_risk asks a node's Docker: its cgroup driver and our running containers."""

    def __init__(self, driver: str, running: list[str]) -> None:
        self.driver, self.running = driver, running

    def cgroup_driver(self) -> str:
        return self.driver

    def list_containers(self, labels: dict[str, str]) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=name, running=True) for name in self.running]


def test_systemd_is_not_reloaded_behind_a_serving_model_under_the_systemd_driver() -> None:
    serving = ["vllm-redeploy-bed-engine"]
    assert reload_risk(_Engine("cgroupfs", serving)) is None  # type: ignore[arg-type]
    assert reload_risk(_Engine("systemd", [])) is None  # type: ignore[arg-type]
    risk = reload_risk(_Engine("systemd", serving))  # type: ignore[arg-type]
    assert risk is not None and "systemd cgroup driver" in risk and serving[0] in risk
    assert reload_risk(_Engine("", serving)) is not None  # unknown: never risk it


def test_the_bed_reports_its_real_cgroup_driver(bed: TestBed) -> None:
    config = load_config(bed.config_path, env_file=None)
    with NodeAccess(config.nodes[0], config) as access:
        assert access.docker.cgroup_driver() in ("cgroupfs", "systemd")
        assert reload_risk(access.docker) is None or "cgroup driver" in str(
            reload_risk(access.docker)
        )


# --- the notifier needs no root (issue 34) ----------------------------------------------------


def test_the_notifier_unit_runs_as_no_root_in_a_sandbox_with_its_secret_as_a_credential(
    tmp_path: Path,
) -> None:
    text = (SCRIPT.parent / UNIT_NAME).read_text()
    service = parse_ini(text)["Service"]
    # A user of its own, made by systemd for the run; never root.
    assert service.get("DynamicUser") == ["yes"] and service.get("User", []) in ([], ["nobody"])
    # systemd reads the root-only secret file for it (0600, what install-notifier writes).
    assert service["LoadCredential"] == [f"notifier.secret:/{SECRET_PATH}"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "CapabilityBoundingSet": None,
    }.items():
        assert service.get(key, [None]) == ([value] if value else []), key
    unit = tmp_path / UNIT_NAME
    unit.write_text(text)
    verified = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert (verified.returncode, verified.stderr) == (0, ""), verified.stderr
    scored = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=20", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scored.returncode == 0, scored.stdout[-400:]  # exposure 2.0 of 10 at most


class _Webhook(http.server.BaseHTTPRequestHandler):
    """A webhook that accepts a call signed with SECRET only."""

    secret = ""

    def do_POST(self) -> None:  # http.server's name for the handler
        body = self.rfile.read(int(self.headers["Content-Length"]))
        stamp = self.headers["X-Vllm-Redeploy-Timestamp"]
        good = hmac.compare_digest(
            self.headers["X-Vllm-Redeploy-Signature"], sign(self.secret, stamp, body)
        )
        self.send_response(202 if good else 401)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_notifier_signs_with_the_credential_systemd_hands_it(tmp_path: Path) -> None:
    """Under its unit the notifier cannot read notifier.secret (root's, 0600): it takes the
    copy in $CREDENTIALS_DIRECTORY that LoadCredential= makes."""
    secret = secrets.token_hex(32)
    _Webhook.secret = secret
    server = http.server.HTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv, env, _ = _notifier(tmp_path, "not-the-secret-" * 4, url, max_wait_s=1)
        (tmp_path / "notifier.secret").unlink()  # what its user cannot open
        credentials = tmp_path / "credentials"
        credentials.mkdir()
        (credentials / "notifier.secret").write_text(secret + "\n")
        (credentials / "notifier.secret").chmod(0o400)
        env["CREDENTIALS_DIRECTORY"] = str(credentials)
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert "202 accepted" in done.stderr and secret not in done.stderr
