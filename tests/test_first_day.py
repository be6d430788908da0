"""README's "Your first day", walked on the bed, command by command, as its operator types them.

node-1 is the controller as well as the head (a Spark that runs the services), reached as its
login ``nvidia`` over SSH: the README's shell. Its /opt/vllm-redeploy and the services' homes are
its own (the bed's /var and /opt are this machine's). The install is the README's: a venv of
root's, `pip install` of a copy of the checkout (from the package registry, as on a controller).
node-2's login has the sudo that preflight recommends only (the bed's "units" kind), so its
notifier asks for its own sudoers line first.
"""

from __future__ import annotations

import base64
import re
import shlex
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from deployments.install_controller import (
    AUTH_CLIENT,
    SERVICE_USER,
    SPOOL_DIR,
    STATE_DIR,
    WEBHOOK_STATE_DIR,
)
from deployments.webhook import SECRET_ENV
from tests.conftest import make_bed
from tests.testbed.bed import TestBed
from tests.testbed.node import EmulatedNode
from tests.testbed.procs import answers, free_port, wait_until
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes import Runner, runner_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "deployments" / "cluster.example.toml"
CLUSTER = "spark-pair"
OPT = "/opt/vllm-redeploy"
VENV_BIN = f"{OPT}/.venv/bin"
VRD = ["sudo", "-n", "-u", SERVICE_USER, f"{VENV_BIN}/vllm-redeploy"]  # the README's alias
SUDO = ["sudo", "-n"]  # the README's sudo: the bed's login needs no password for it
SERVER_START_S = 120


@dataclass
class Shell:
    """The operator's shell on the controller: every command is logged, in order."""

    runner: Runner
    typed: list[str]

    def __call__(
        self, argv: list[str], stdin: str | None = None, timeout: float = 180, ok: bool = True
    ) -> subprocess.CompletedProcess[str]:
        self.typed.append(shlex.join(argv))
        data = stdin.encode() if stdin else None
        done = self.runner.run(argv, stdin=data, timeout=timeout, check=False)
        result = subprocess.CompletedProcess(argv, done.exit_code, done.stdout, done.stderr)
        if ok:
            assert result.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}\n{done.stderr}"
        return result


@dataclass
class Day:
    bed: TestBed
    controller: EmulatedNode
    shell: Shell
    api: str
    webhook: str
    install: list[str]


def _checkout(work: Path) -> Path:
    """What `git clone` gives: the tracked files (and new ones not ignored), nothing built."""
    src = work / "vllm-redeploy"
    src.mkdir()
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / name.decode()
        if source.is_file():
            (src / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, src / name.decode())
    return src


def _edit(shell: Shell, path: str, text: str) -> None:
    """What the operator adds with sudoedit: appended, through sudo, the text on stdin."""
    shell([*SUDO, "sh", "-c", 'cat >> "$1"', "sh", path], stdin=text)


@pytest.fixture(scope="module")
def day() -> Iterator[Day]:
    bed = make_bed(2, "h200", first_ip=143)
    work = Path(tempfile.mkdtemp(prefix="vrd-first-day-", dir="/tmp"))
    work.chmod(0o755)  # the login reads the checkout
    try:
        controller = bed.node("node-1")
        for path in (OPT, STATE_DIR, WEBHOOK_STATE_DIR, SPOOL_DIR):
            controller.own_dir(Path(path))
            controller.run(["chown", "root:root", path])
        config = load_config(bed.config_path, env_file=None)  # the bed's own way in: SSH
        with runner_for(config.nodes[0], config) as runner:
            shell = Shell(runner, [])
            yield _first_day(bed, controller, shell, work)
    finally:
        for unit in ("serve", "webhook", "watch"):
            bed.node("node-1").systemctl("stop", f"vllm-redeploy-{unit}@{CLUSTER}.service")
        bed.node("node-1").systemctl("stop", "vllm-redeploy-prefect.service")
        bed.down()
        shutil.rmtree(work, ignore_errors=True)


def _first_day(bed: TestBed, controller: EmulatedNode, shell: Shell, work: Path) -> Day:
    # 1. Install, in a root-owned environment the services can run.
    src = _checkout(work)
    shell([*SUDO, "python3", "-m", "venv", f"{OPT}/.venv"])
    shell([*SUDO, f"{VENV_BIN}/pip", "install", "-q", str(src)], timeout=600)

    # 2. Describe the cluster from the shipped example, then check it.
    shell([f"{VENV_BIN}/vllm-redeploy", "init", f"{CLUSTER}.toml"])
    assert shell(["cat", f"{CLUSTER}.toml"]).stdout == EXAMPLE.read_text()
    hook_port, api_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    webhook = f"http://127.0.0.1:{hook_port}"
    described = bed.write_config(
        work / "described.toml",
        name=CLUSTER,  # type: ignore[arg-type]
        # The example's SSH settings: the default keys and ~/.ssh/known_hosts.
        ssh={"key_file": None, "known_hosts": "~/.ssh/known_hosts"},
        webhook={"host": "127.0.0.1", "port": hook_port, "url": webhook},
    )
    shell(["sh", "-c", f"cat > {CLUSTER}.toml"], stdin=described.read_text())
    shell([f"{VENV_BIN}/vllm-redeploy", "check-config", "-c", f"{CLUSTER}.toml"])

    # 3. Install the services, the secrets, again, then start the server.
    install_controller = [*SUDO, f"{VENV_BIN}/vllm-redeploy", "install-controller"]
    first = shell([*install_controller, "-c", f"{CLUSTER}.toml", "--enable"]).stdout
    secret = uuid.uuid4().hex + uuid.uuid4().hex
    api = f"http://127.0.0.1:{api_port}/api"
    _edit(shell, "/etc/vllm-redeploy/prefect.env", f"PREFECT_SERVER_API_PORT={api_port}\n")
    _edit(
        shell,
        f"/etc/vllm-redeploy/{CLUSTER}.env",
        f"PREFECT_API_URL={api}\n{SECRET_ENV}={secret}\n",
    )
    shell([*install_controller, "-c", f"{CLUSTER}.toml"])
    # The notes' commands: the key the nodes authorize (one made before, moved in as
    # docs/operations.md says) and the nodes' host keys, scanned as the note has it.
    key = f"{STATE_DIR}/.ssh/id_ed25519"
    shell([*SUDO, "install", "-m", "0600", "-o", SERVICE_USER, "-g", SERVICE_USER,
           str(bed.client_key), key])  # fmt: skip
    scan = re.search(r"then: (ssh-keyscan .*)$", first, re.M)
    assert scan, first
    shell(["sh", "-c", scan.group(1)])
    shell([*SUDO, "systemctl", "start", "vllm-redeploy-prefect"])
    wait_until(lambda: answers(f"{api}/health"), SERVER_START_S, "the Prefect server's unit")
    return Day(bed, controller, shell, api, webhook, first.splitlines())


def test_the_install_leaves_the_services_and_names_what_ssh_still_needs(day: Day) -> None:
    lines = day.install
    assert (
        f"{STATE_DIR}/.ssh: made (0700, {SERVICE_USER}'s: the services' SSH key and known_hosts)"
        in lines
    )
    notes = [line for line in lines if line.startswith("note: the services'")]
    assert len(notes) == 2 and f"{STATE_DIR}/.ssh/id_ed25519 does not exist" in notes[0]
    env = day.shell([*SUDO, "cat", f"/etc/vllm-redeploy/{CLUSTER}.env"]).stdout
    assert f"{AUTH_CLIENT}=" in env
    # What the note's scan wrote is what the bed's sshd holds.
    held = day.shell([*SUDO, "cat", f"{STATE_DIR}/.ssh/known_hosts"]).stdout.split("\n")
    for node in day.bed.nodes:
        kind, key = node.sshd.known_hosts_line().split()[1:3]
        assert any(line.split()[1:3] == [kind, key] for line in held if line)


def test_the_first_run_by_hand_serves_then_the_services_and_the_notifiers_take_over(
    day: Day,
) -> None:
    shell = day.shell
    # 4. Check, then the first run, as the services' user.
    nodes = shell([*VRD, "nodes", "-c", CLUSTER])
    assert "node-1" in nodes.stdout and "node-2" in nodes.stdout
    dry = shell([*VRD, "run", "--dry-run", "-c", CLUSTER])
    assert "node-2" in dry.stdout
    served = shell([*VRD, "run", "-c", CLUSTER], timeout=600)
    assert "probe" in served.stdout.lower(), served.stdout
    units = [f"vllm-redeploy-{kind}@{CLUSTER}" for kind in ("serve", "webhook", "watch")]
    # The bed's systemctl runs every service as root: the spool is root's, as it is the
    # webhook user's where systemd gives the webhook that user (the webhook refuses another's).
    day.controller.run(["chown", "root", SPOOL_DIR])
    shell([*SUDO, "systemctl", "start", *units])
    for unit in units:
        assert day.controller.systemctl("is-active", unit).stdout == "active\n", unit
    wait_until(lambda: answers(f"{day.webhook}/healthz"), 60, "the webhook's unit")
    # serve registered the cluster's deployments, the nightly one on the file's schedule.
    env = shell([*SUDO, "cat", f"/etc/vllm-redeploy/{CLUSTER}.env"]).stdout
    auth = next(v for k, _, v in (x.partition("=") for x in env.splitlines()) if k == AUTH_CLIENT)
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    wanted = {f"{CLUSTER}-{kind}" for kind in ("after-reboot", "manual", "nightly", "recover")}

    def registered() -> set[str]:
        found = httpx.post(f"{day.api}/deployments/filter", json={}, headers=headers)
        return {d["name"] for d in found.json()} if found.status_code == 200 else set()

    wait_until(lambda: wanted <= registered(), 120, "serve's deployments")

    # 5. The notifier on every node; node-2's login is refused first, naming its line.
    shell([*VRD, "install-notifier", "node-1", "-c", CLUSTER])
    refused = shell([*VRD, "install-notifier", "node-2", "-c", CLUSTER], ok=False)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    line = re.search(r"with the line `([^`]+)`", refused.stderr)
    assert line, refused.stderr
    day.bed.node("node-2").write_file(
        "/etc/sudoers.d/50-vllm-redeploy-notifier", line.group(1) + "\n", mode=0o440
    )
    shell([*VRD, "install-notifier", "node-2", "-c", CLUSTER])

    # 7. Every day: status on one screen; pause and resume.
    status = shell([*VRD, "status", "-c", CLUSTER])
    assert CLUSTER in status.stdout
    shell([*VRD, "pause", "-c", CLUSTER, "--reason", "cables"])
    assert "paused" in shell([*VRD, "status", "-c", CLUSTER], ok=False).stdout.lower()
    shell([*VRD, "resume", "-c", CLUSTER])
