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
from tests.testbed.dockerd import DockerEngine
from tests.testbed.procs import free_port
from tests.testbed.sshd import SSHServer

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
