"""`vllm-redeploy nodes` against real sshd and dockerd."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from tests.conftest import NODE_IP
from tests.testbed.dockerd import DockerEngine
from tests.testbed.procs import free_port
from tests.testbed.sshd import SSHServer, keygen

pytestmark = pytest.mark.integration


def cluster_toml(
    tmp_path: Path,
    sshd: SSHServer,
    key: Path,
    known_hosts: Path,
    dockerd: DockerEngine,
    extra_nodes: str = "",
) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(f"""
name = "bed"
[[nodes]]
name = "head-local"
address = "127.0.0.1"
transport = "local"
docker_host = "{dockerd.url}"
[[nodes]]
name = "worker-ssh"
address = "{sshd.host}"
ssh_port = {sshd.port}
ssh_user = "root"
ssh_key_file = "{key}"
{extra_nodes}
[ssh]
known_hosts = "{known_hosts}"
connect_timeout_s = 3
[vllm]
image = "vrd-test/busybox:1"
model = "/models/m"
""")
    return path


def test_nodes_reports_each_node_reachable_with_docker(
    tmp_path: Path, sshd: SSHServer, client_key: Path, known_hosts: Path, dockerd: DockerEngine
) -> None:
    path = cluster_toml(tmp_path, sshd, client_key, known_hosts, dockerd)
    result = CliRunner().invoke(app, ["nodes", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    reports = {r["name"]: r for r in json.loads(result.output)}
    version = dockerd.client().version()["Version"]
    for name in ("head-local", "worker-ssh"):
        assert reports[name]["reachable"] and reports[name]["docker_version"] == version
        assert 0 < reports[name]["rtt_ms"] < 2000


def test_unreachable_node_is_named_in_plain_words_and_exit_1(
    tmp_path: Path, sshd: SSHServer, client_key: Path, known_hosts: Path, dockerd: DockerEngine
) -> None:
    down = f"""
[[nodes]]
name = "worker-down"
address = "127.0.0.98"
ssh_port = {sshd.port}
ssh_key_file = "{client_key}"
"""
    path = cluster_toml(tmp_path, sshd, client_key, known_hosts, dockerd, down)
    result = CliRunner().invoke(app, ["nodes", "--config", str(path)])
    assert result.exit_code == 1
    assert "worker-down" in result.output and "connection refused" in result.output
    assert result.output.count("yes") == 2 and "Traceback" not in result.output


# --- a port that answers but does not speak SSH (issue 12) ------------------------------------


@pytest.fixture
def not_sshd() -> Iterator[tuple[str, int]]:
    """A listener where a node's sshd should be that answers like a web server and hangs up,
    as another service on the port or a proxy in front of sshd would."""
    host = "127.0.0.97"
    server = socket.create_server((host, free_port(host)))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield host, server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def one_node_toml(
    name: str, host: str, port: int, known_hosts: Path, key_file: Path | str | None = None
) -> str:
    """A cluster of one node at ``host:port`` that gives up on it within a second or so."""
    key = f'ssh_key_file = "{key_file}"\n' if key_file is not None else ""
    return f"""
name = "{name}"
[[nodes]]
name = "node-1"
address = "{host}"
ssh_port = {port}
{key}[ssh]
known_hosts = "{known_hosts}"
connect_timeout_s = 3
[deadlines]
nodes_reachable_s = 1
[vllm]
image = "vrd-test/busybox:1"
model = "/models/m"
"""


@pytest.mark.parametrize(
    "command",
    [["nodes"], ["run", "--dry-run"], ["status"], ["run", "--temporary-api"]],
    ids=["nodes", "dry-run", "status", "run"],
)
def test_a_port_that_is_not_sshd_gives_one_line_and_no_traceback(
    tmp_path: Path, not_sshd: tuple[str, int], client_key: Path, command: list[str]
) -> None:
    host, port = not_sshd
    path = tmp_path / "cluster.toml"
    path.write_text(one_node_toml("bed", host, port, tmp_path / "known_hosts", client_key))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    result = subprocess.run(
        [str(Path(sys.executable).parent / "vllm-redeploy"), *command, "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
    )
    shown = result.stdout + result.stderr
    assert result.returncode != 0 if command != ["run", "--dry-run"] else result.returncode == 0
    for noise in ("Traceback", "Exception (client)", "paramiko", "SSHException"):
        assert noise not in shown, shown
    flat = re.sub(r"[\s│]+", " ", shown)  # the table may wrap the problem anywhere
    assert "Error reading SSH protocol banner" in flat
    assert "Something answers on that port but does not speak SSH" in flat, shown


# --- every failure `check_node` meets is a row of the table (issue 50) ---------------------------


@pytest.fixture
def sshd_without_docker(tmp_path: Path, client_key: Path) -> Iterator[SSHServer]:
    """An sshd whose sessions' Docker is a socket nobody listens on (the engine stopped)."""
    server = SSHServer(
        tmp_path / "sshd-no-docker",
        NODE_IP,
        [client_key],
        env={"DOCKER_HOST": f"unix://{tmp_path}/stopped/docker.sock"},
    ).start()
    yield server
    server.stop()


def test_docker_failing_on_nodes_is_their_problem_in_the_table(
    tmp_path: Path,
    sshd_without_docker: SSHServer,
    client_key: Path,
    dockerd: DockerEngine,
) -> None:
    """The local node's Docker socket and the SSH node's are both dead: each row says so (the
    SSH node's in the words of `docker system dial-stdio`), with no traceback, and exit 1."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd_without_docker.known_hosts_line())
    path = cluster_toml(tmp_path, sshd_without_docker, client_key, known_hosts, dockerd)
    path.write_text(path.read_text().replace(dockerd.url, f"unix://{tmp_path}/absent/docker.sock"))
    table = CliRunner().invoke(app, ["nodes", "--config", str(path)], terminal_width=400)
    assert table.exit_code == 1, table.output
    assert not isinstance(table.exception, Exception) or isinstance(table.exception, SystemExit)
    assert "Docker on head-local: version failed" in table.output, table.output
    found = CliRunner().invoke(app, ["nodes", "--config", str(path), "--json"])
    reports = {r["name"]: r for r in json.loads(found.output)}
    for name in ("head-local", "worker-ssh"):
        assert reports[name]["reachable"] and reports[name]["docker_version"] is None, reports
        assert reports[name]["error"].startswith(f"Docker on {name}: version failed"), reports
    said = reports["worker-ssh"]["error"]  # dial-stdio's own words, not "Connection aborted"
    assert f"dial unix {tmp_path}/stopped/docker.sock: connect: no such file" in said, said


def test_a_known_hosts_with_markers_is_read_as_openssh_reads_it(
    tmp_path: Path, sshd: SSHServer, client_key: Path, dockerd: DockerEngine
) -> None:
    """A @cert-authority line and a @revoked line for another key are read past (paramiko's own
    loader raised InvalidHostKey on both); the node's key marked @revoked is refused."""
    other = keygen(tmp_path / "other")
    other_key = Path(f"{other}.pub").read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(
        f"@cert-authority *.example.org {' '.join(other_key)}\n"
        f"@revoked * {' '.join(other_key)}\n" + sshd.known_hosts_line()
    )
    path = cluster_toml(tmp_path, sshd, client_key, known_hosts, dockerd)
    found = CliRunner().invoke(app, ["nodes", "--config", str(path), "--json"])
    reports = {r["name"]: r for r in json.loads(found.output)}
    assert reports["worker-ssh"]["docker_version"], reports
    kind, key = sshd.known_hosts_line().split()[1:3]
    known_hosts.write_text(known_hosts.read_text() + f"@revoked * {kind} {key}\n")
    found = CliRunner().invoke(app, ["nodes", "--config", str(path), "--json"])
    reports = {r["name"]: r for r in json.loads(found.output)}
    assert not reports["worker-ssh"]["reachable"], reports
    assert "is marked @revoked in" in reports["worker-ssh"]["error"], reports


def test_check_gpus_calls_a_node_it_cannot_reach_unreachable_not_busy(
    tmp_path: Path, sshd: SSHServer, client_key: Path, dockerd: DockerEngine
) -> None:
    """The same keys as `nodes --json` (``name``, ``reachable``); a node never reached is not
    "busy": nobody looked at its GPUs."""
    known_hosts = tmp_path / "known_hosts"
    kind, key = sshd.known_hosts_line().split()[1:3]
    known_hosts.write_text(sshd.known_hosts_line() + f"@revoked * {kind} {key}\n")
    path = cluster_toml(tmp_path, sshd, client_key, known_hosts, dockerd)
    found = CliRunner().invoke(app, ["check-gpus", "--config", str(path), "--json"])
    assert found.exit_code == 1, found.output
    rows = {r["name"]: r for r in json.loads(found.output)}
    assert not rows["worker-ssh"]["reachable"] and not rows["worker-ssh"]["clear"], rows
    assert "is marked @revoked in" in rows["worker-ssh"]["problems"][0], rows
    shown = CliRunner().invoke(app, ["check-gpus", "--config", str(path)], terminal_width=400)
    assert "worker-ssh: unreachable (its GPUs not checked)" in shown.output, shown.output
    assert "worker-ssh: busy" not in shown.output
