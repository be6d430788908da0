"""Session-wide real servers: one Docker engine and one OpenSSH node that reaches it.

Each is started once per test session (they cost seconds) on loopback; tests that change
state make their own containers and clean them up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fuzz import describe_profile
from tests.testbed.bed import TestBed, bed_ip
from tests.testbed.dockerd import DockerEngine
from tests.testbed.procs import (
    claim,
    drain_prefect_workers,
    free_port,
    spawn,
    stop,
    sweep_abandoned,
    wait_until,
)
from tests.testbed.sshd import SSHServer, keygen
from vllm_redeploy.nodes import SSHRunner, SSHTarget

NODE_IP = bed_ip(11)
TEST_IMAGE = "vrd-test/busybox:1"


def pytest_report_header() -> str:
    return describe_profile()


def _need(program: str) -> None:
    if shutil.which(program) is None and not Path(program).exists():
        pytest.fail(
            f"{program} is not installed: run .ci/run (or apt-get install it)", pytrace=False
        )


# The slowest modules first, longest first (the CI log's table of the slowest modules, at
# e551e75): each worker then ends on short ones instead of one worker running a long module
# while the others are done. xdist hands out whole modules in collection order, given
# --no-loadscope-reorder (pyproject.toml; by default it orders them by their count of tests).
SLOWEST_FIRST = (
    "test_controller_outages.py",
    "test_faults.py",
    "test_real_vllm.py",
    "test_hands_off.py",
    "test_recovery.py",
    "test_lock_holder.py",
    "test_cluster_lock.py",
    "test_mp_backend.py",
    "test_scale_out.py",
    "test_bench_smoke.py",
    "test_rdma_flow.py",
    "test_first_day.py",
    "test_alerts.py",
    "test_flow.py",
    "test_status.py",
    "test_sync.py",
)


# What each collected test is marked and which fixtures it uses, before `-m` deselects any:
# tests/test_suite_marks.py reads it.
MARK_AUDIT = pytest.StashKey[list[dict[str, Any]]]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    # Stable: a module's tests, and the modules not listed, keep their order.
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FIRST)))
    config.stash[MARK_AUDIT] = [
        {
            "nodeid": item.nodeid,
            "module": item.path.name,
            "function": getattr(item, "originalname", item.name),
            "integration": item.get_closest_marker("integration") is not None,
            "fixtures": sorted(getattr(item, "fixturenames", ())),
        }
        for item in items
    ]


def pytest_collection_finish(session: pytest.Session) -> None:
    """With VRD_MARK_AUDIT=FILE: the audit above, as JSON (a collection of its own)."""
    if target := os.environ.get("VRD_MARK_AUDIT"):
        Path(target).write_text(json.dumps(session.config.stash[MARK_AUDIT]))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Prefect sets its console handler up on first use, on the sys.stderr of that moment: in a
    test session, pytest's capture, whose file is closed after this hook. What Prefect logs at
    interpreter exit (a worker's last try to send to a server that has stopped) then ended the
    run's output with "--- Logging error --- ... I/O operation on closed file". Those handlers
    write to the real stderr from here on."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            stream = getattr(handler, "stream", None)
            if type(stream).__module__ == "_pytest.capture":
                handler.setStream(sys.__stderr__)  # type: ignore[attr-defined]
                if console := getattr(handler, "console", None):  # Prefect's: a rich Console
                    console.file = sys.__stderr__


def pytest_sessionstart(session: pytest.Session) -> None:
    """Daemons of a test session that was killed (Ctrl-C twice, a CI timeout) outlive it; they
    would hold the bed's addresses and ports. Remove them before this session starts its own."""
    for directory in sweep_abandoned():
        print(f"removed what an earlier, killed test session left: {directory}")


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    # Short path: unix socket paths under it must stay below 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="vrd-", dir="/tmp"))
    claim(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def client_key(workdir: Path) -> Path:
    return keygen(workdir / "id_client")


@pytest.fixture(scope="session")
def dockerd(workdir: Path) -> Iterator[DockerEngine]:
    _need("dockerd")
    engine = DockerEngine(workdir / "d").start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def test_image(dockerd: DockerEngine) -> str:
    return dockerd.import_busybox(TEST_IMAGE)


@pytest.fixture(scope="session")
def sshd(workdir: Path, client_key: Path, dockerd: DockerEngine) -> Iterator[SSHServer]:
    _need("/usr/sbin/sshd")
    server = SSHServer(
        workdir / "sshd", NODE_IP, [client_key], env={"DOCKER_HOST": dockerd.url}
    ).start()
    yield server
    server.stop()


@pytest.fixture
def known_hosts(tmp_path: Path, sshd: SSHServer) -> Path:
    path = tmp_path / "known_hosts"
    path.write_text(sshd.known_hosts_line())
    return path


@pytest.fixture
def target(sshd: SSHServer, client_key: Path, known_hosts: Path) -> SSHTarget:
    return SSHTarget(
        host=sshd.host, port=sshd.port, user="root", key_file=client_key, known_hosts=known_hosts
    )


@pytest.fixture
def ssh_runner(target: SSHTarget) -> Iterator[SSHRunner]:
    with SSHRunner("node-a", target) as runner:
        yield runner


@pytest.fixture(scope="session")
def prefect_server(workdir: Path) -> Iterator[str]:
    """A real `prefect server start` on loopback (its own PREFECT_HOME, SQLite), one per
    session; yields its API URL. Flow runs, deployments, events and triggers all go here."""
    home = workdir / "prefect-home"
    home.mkdir()
    port = free_port("127.0.0.1")
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_URL": "",
    }
    prefect = str(Path(sys.executable).parent / "prefect")
    log = workdir / "prefect-server.log"
    proc = spawn([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], log, env)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_until(lambda: _healthy(f"{url}/health"), 90, "prefect server", log)
        yield url
    finally:
        drain_prefect_workers()  # while the server still answers
        stop(proc, grace=15)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def prefect_api(prefect_server: str) -> Iterator[str]:
    """Point this process's Prefect client at the session's server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        os.environ["PREFECT_API_URL"] = prefect_server
        yield prefect_server
        os.environ.pop("PREFECT_API_URL", None)


OUTPUT = Path(__file__).resolve().parent / "output"


def keep_for_notes(name: str, text: str) -> None:
    """What a person reads after a run (its summary, a failure's message) in tests/output/NAME.md
    (gitignored): the real text for the team's notes and reviews."""
    OUTPUT.mkdir(exist_ok=True)
    (OUTPUT / f"{name}.md").write_text(text)


# A run's [vllm] changes that put it on Ray, for a row on an mp bed whose assertions name Ray.
RAY = {"backend": "ray"}


def make_bed(nodes: int, gpu: str, first_ip: int, backend: str = "mp", **options: Any) -> TestBed:
    """A bed of ``nodes`` at NET.<first_ip>...; ``options`` go to TestBed.up (image, rdma).

    Its runs take vLLM's own launcher unless a test asks for ``backend="ray"`` (what it asserts
    names Ray) or ``"auto"`` (the choice itself): Ray costs ~12 s more per run and keeps two
    cores busy while idle, which every row that does not test Ray would pay for nothing."""
    _need("dockerd")
    _need("/usr/sbin/sshd")
    root = Path(tempfile.mkdtemp(prefix="vrd-bed-", dir="/tmp"))
    bed = TestBed.up(nodes, gpu, root, first_ip=first_ip, backend=backend, **options)
    claim(root)
    return bed


@pytest.fixture(autouse=True, scope="session")
def _no_user_env() -> Iterator[None]:
    """Tests must not pick up a developer's VLLM_REDEPLOY_* variables."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("VLLM_REDEPLOY_")}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session")
def bed() -> Iterator[TestBed]:
    """Two emulated GPU nodes (sshd + dockerd each, the bed image, the old autostart stack)."""
    testbed = make_bed(2, "h200", first_ip=11)
    yield testbed
    testbed.down()
