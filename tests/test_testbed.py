"""The test bed itself: emulated nodes with real sshd, Docker and Ray."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.testbed import image
from tests.testbed.bed import TestBed, bed_ip
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.launch.ray import ray_container, ray_spec
from vllm_redeploy.nodes import (
    ContainerSpec,
    HostKeyRejected,
    NodeAccess,
)
from vllm_redeploy.nodes.containers import LABEL_CLUSTER
from vllm_redeploy.nodes.result import CommandResult

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def config(bed: TestBed) -> ClusterConfig:
    return load_config(bed.config_path, env_file=None)


@pytest.fixture
def access(config: ClusterConfig) -> Iterator[dict[str, NodeAccess]]:
    nodes = {n.name: NodeAccess(n, config) for n in config.nodes}
    yield nodes
    for node in nodes.values():
        node.close()


def test_nodes_are_reachable_over_ssh_with_their_own_login_env(
    access: dict[str, NodeAccess], bed: TestBed
) -> None:
    for name, node in access.items():
        result = node.runner.run(
            ["sh", "-c", 'command -v nvidia-smi; echo "$DOCKER_HOST"'], timeout=10
        )
        emulated = bed.node(name)
        assert result.stdout.splitlines() == [
            str(emulated.bin_dir / "nvidia-smi"),
            emulated.engine.url,
        ]


def test_host_keys_are_checked(config: ClusterConfig, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    strict = config.model_copy(update={"ssh": config.ssh.model_copy(update={"known_hosts": empty})})
    with NodeAccess(strict.nodes[1], strict) as node, pytest.raises(HostKeyRejected):
        node.runner.run(["true"], timeout=10)


def test_each_node_has_its_own_docker_engine(
    access: dict[str, NodeAccess], config: ClusterConfig
) -> None:
    name = f"only-on-1-{uuid.uuid4().hex[:6]}"
    one, two = access["node-1"].docker, access["node-2"].docker
    one.run_detached(ContainerSpec(name=name, image=image.OLD_STACK_IMAGE, command=["sleep", "60"]))
    try:
        assert one.get(name) is not None and two.get(name) is None
        assert one.image_id(config.vllm.image) == two.image_id(config.vllm.image) is not None
    finally:
        one.remove(name)


def test_the_old_stack_autostarts_on_every_node(access: dict[str, NodeAccess]) -> None:
    for node in access.values():
        names = {c.name: c for c in node.docker.list_containers(["glm-*"])}
        assert set(names) == {"glm-server", "glm-proxy"} and all(c.running for c in names.values())
        assert names["glm-proxy"].restart_policy == "unless-stopped"
        unit = node.runner.run(
            ["systemctl", "is-active", "glm-server.service"], timeout=10, check=False
        )
        assert (unit.exit_code, unit.stdout) == (0, "active\n")


def test_systemctl_standin_stops_and_disables_like_systemd(
    access: dict[str, NodeAccess], bed: TestBed
) -> None:
    node = access["node-1"]  # its login may use sudo: systemd obeys root only

    def run(argv: list[str], **options: Any) -> CommandResult:
        return node.runner.run(["sudo", "-n", *argv], **options)

    try:
        run(["systemctl", "stop", "glm-server.service"], timeout=20)
        assert (
            run(["systemctl", "is-active", "glm-server.service"], timeout=10, check=False).exit_code
            == 3
        )
        assert node.docker.get("glm-server") is None
        run(["systemctl", "disable", "glm-server.service"], timeout=10)
        disabled = run(["systemctl", "is-enabled", "glm-server.service"], timeout=10, check=False)
        assert (disabled.exit_code, disabled.stdout) == (1, "disabled\n")
        missing = run(["systemctl", "stop", "nope.service"], timeout=10, check=False)
        assert missing.exit_code == 5 and "Unit nope.service not loaded." in missing.stderr
    finally:
        run(["systemctl", "enable", "glm-server.service"], timeout=10)
        run(["systemctl", "start", "glm-server.service"], timeout=20)


@pytest.fixture
def ray_cluster(access: dict[str, NodeAccess], config: ClusterConfig) -> Iterator[ClusterConfig]:
    """The product's own Ray containers, under a cluster name of this test's."""
    cluster = config.model_copy(update={"name": f"t{uuid.uuid4().hex[:6]}"})
    try:
        for node in cluster.nodes:
            access[node.name].docker.run_detached(ray_spec(node, cluster))
        yield cluster
    finally:
        for node in access.values():
            with contextlib.suppress(Exception):
                node.docker.remove(ray_container(cluster))


def test_ray_cluster_forms_across_the_nodes(
    access: dict[str, NodeAccess], config: ClusterConfig, ray_cluster: ClusterConfig
) -> None:
    head = access[config.head.name].docker.exec_runner(ray_container(ray_cluster))
    probe = (
        "import ray; ray.init(address='auto', logging_level='ERROR'); "
        "print(sorted((n['NodeManagerAddress'], n['Resources'].get('GPU', 0)) "
        "for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline:
        result = head.run(["python3", "-c", probe], timeout=30, check=False)
        seen = result.stdout.strip()
        if seen == str(sorted((n.ip, float(n.gpus)) for n in config.nodes)):
            break
        time.sleep(1)
    assert seen == str(sorted((n.ip, float(n.gpus)) for n in config.nodes))
    mine = access["node-2"].docker.list_containers(labels={LABEL_CLUSTER: ray_cluster.name})
    assert [c.name for c in mine] == [ray_container(ray_cluster)]


def test_reboot_brings_autostart_back_and_nothing_else(
    access: dict[str, NodeAccess], config: ClusterConfig, ray_cluster: ClusterConfig, bed: TestBed
) -> None:
    node = access["node-2"]
    assert node.docker.get(ray_container(ray_cluster)).running  # type: ignore[union-attr]
    bed.reboot("node-2")
    # The old connection died with the node; the runner reconnects by itself.
    assert node.runner.run(["true"], timeout=10).ok
    restarted = {c.name: c.running for c in node.docker.list_containers(["glm-*"])}
    assert restarted == {"glm-server": True, "glm-proxy": True}
    ray = node.docker.get(ray_container(ray_cluster))
    assert ray is not None and not ray.running  # restart policy "no": runtime state is gone
    assert access["node-1"].docker.get(ray_container(ray_cluster)).running  # type: ignore[union-attr]


def test_nvidia_smi_on_each_node_shows_that_nodes_gpu_processes(
    access: dict[str, NodeAccess], bed: TestBed
) -> None:
    query = [
        "nvidia-smi",
        "--query-compute-apps=pid,process_name,used_memory",
        "--format=csv,noheader,nounits",
    ]
    holder = bed.node("node-2").hold_gpu(20998, "python3")
    try:
        assert access["node-1"].runner.run(query, timeout=10).stdout == ""
        listed = access["node-2"].runner.run(query, timeout=10).stdout
        assert listed == f"{holder.pid}, python3, 20998\n"
        table = access["node-2"].runner.run(["nvidia-smi"], timeout=10).stdout
        assert "NVIDIA H200" in table and str(holder.pid) in table
    finally:
        holder.kill()
        holder.wait()
    assert access["node-2"].runner.run(query, timeout=10).stdout == ""


def test_the_bed_command_line_brings_a_bed_up_and_removes_it() -> None:
    # Not tmp_path: containerd's socket path under the root must stay below 108 bytes.
    top = Path(tempfile.mkdtemp(prefix="vrd-cli-", dir="/tmp"))
    top.chmod(0o755)  # the nodes' login reaches the bed below it
    root = top / "b"
    bed = [sys.executable, "-m", "tests.testbed", "--root", str(root)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*bed, *args], capture_output=True, text=True, timeout=120)

    up = run("up", "--nodes", "1", "--first-ip", "130", "--no-old-stack")
    try:
        assert up.returncode == 0, up.stderr
        config = load_config(Path(up.stdout.strip()), env_file=None)
        assert [n.ip for n in config.nodes] == [bed_ip(130)]
        assert run("up", "--nodes", "1").returncode == 2  # one bed per root
        assert f"node-1 {bed_ip(130)}" in run("status").stdout
        assert run("reboot", "node-1").returncode == 0
        assert "sshd up, docker up" in run("status").stdout
    finally:
        assert run("down").returncode == 0
    assert not root.exists()
    root.parent.rmdir()
