"""`vllm-redeploy nodes` against real sshd and dockerd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.testbed.dockerd import DockerEngine
from tests.testbed.sshd import SSHServer
from vllm_redeploy.cli import app

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
