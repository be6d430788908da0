"""Docker operations through the docker SDK, on a real engine: locally and over SSH; and an
engine that never answers (a socket that accepts and stays silent)."""

from __future__ import annotations

import contextlib
import io
import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest

from tests.conftest import TEST_IMAGE
from tests.testbed.dockerd import DockerEngine
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch.caches import cache_owner, own_cache_spec
from vllm_redeploy.nodes import (
    CommandFailed,
    CommandTimedOut,
    ContainerSpec,
    LocalRunner,
    NodeDocker,
    SSHRunner,
    project_labels,
)
from vllm_redeploy.nodes.containers import LABEL_CLUSTER
from vllm_redeploy.nodes.docker import DockerError, node_docker_for
from vllm_redeploy.nodes.ssh import MAX_CHANNELS

pytestmark = pytest.mark.integration


@pytest.fixture(params=["local", "ssh"])
def node_docker(request: pytest.FixtureRequest, dockerd: DockerEngine) -> Iterator[NodeDocker]:
    if request.param == "local":
        node = node_docker_for(LocalRunner("node-a"), dockerd.url)
    else:
        node = node_docker_for(request.getfixturevalue("ssh_runner"))
    yield node
    node.close()


@pytest.fixture
def engine(dockerd: DockerEngine, test_image: str) -> Iterator[object]:
    """The engine's own client, for setting up what a node had before we came."""
    client = dockerd.client()
    made: list[str] = []
    client.made = made  # type: ignore[attr-defined]
    yield client
    for name in made:
        with contextlib.suppress(Exception):
            client.containers.get(name).remove(force=True)
    client.close()


def _autostart(engine, name: str) -> None:  # type: ignore[no-untyped-def]
    """A container like the previous model's stack: restart policy unless-stopped."""
    engine.made.append(name)
    engine.containers.run(
        "vrd-test/busybox:1",
        ["sleep", "600"],
        name=name,
        detach=True,
        network_mode="host",
        restart_policy={"Name": "unless-stopped"},
    )


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_version_and_image_id(node_docker: NodeDocker, engine, test_image: str) -> None:  # type: ignore[no-untyped-def]
    """The image's ID is what it holds (layers and configuration), not the engine's own ID:
    another image store names the same image otherwise (tests/test_docker29.py)."""
    assert node_docker.version().startswith("20.") or node_docker.version()[0].isdigit()
    found = node_docker.image_id("vrd-test/busybox:1")
    assert found is not None and found != test_image and found.startswith("sha256:")
    layers = engine.images.get(test_image).attrs["RootFS"]["Layers"]
    copy = engine.images.get(test_image)
    copy.tag("vrd-test/busybox-again", "1")  # the same content under another name
    try:
        assert node_docker.image_id("vrd-test/busybox-again:1") == found and layers
    finally:
        engine.images.remove("vrd-test/busybox-again:1")
    assert node_docker.image_id("vrd-test/absent:1") is None


def test_stop_remove_and_restart_policy_of_autostart_containers(
    node_docker: NodeDocker, engine
) -> None:  # type: ignore[no-untyped-def]
    tag = _unique("glm")
    _autostart(engine, f"{tag}-server")
    _autostart(engine, f"{tag}-proxy")
    canary = _unique("canary")
    _autostart(engine, canary)

    found = node_docker.list_containers([f"{tag}-*"])
    assert sorted(c.name for c in found) == [f"{tag}-proxy", f"{tag}-server"]
    assert all(c.running and c.restart_policy == "unless-stopped" for c in found)

    server = f"{tag}-server"
    node_docker.set_restart_policy(server, "no")
    assert engine.containers.get(server).attrs["HostConfig"]["RestartPolicy"]["Name"] == "no"
    node_docker.stop(server, timeout_s=1)
    info = node_docker.get(server)
    assert info is not None and info.status == "exited" and not info.running
    node_docker.remove(server)
    node_docker.remove(f"{tag}-proxy")  # force-removes a running container
    assert node_docker.get(server) is None and node_docker.list_containers([f"{tag}-*"]) == []
    node_docker.stop(server)  # already gone: no error
    node_docker.remove(server)
    assert engine.containers.get(canary).status == "running"  # not named, not touched


def test_nothing_is_listed_unless_named(node_docker: NodeDocker, engine) -> None:  # type: ignore[no-untyped-def]
    _autostart(engine, _unique("other"))
    assert node_docker.list_containers() == []


def test_a_container_removed_while_listing_is_left_out(dockerd: DockerEngine, engine) -> None:  # type: ignore[no-untyped-def]
    """Listing is one call for the IDs, then one inspect per container; a container removed in
    between (preflight's `docker run --rm` of the image, on the same node, at the same time) is
    gone, not an error that fails the run."""
    node_docker = node_docker_for(LocalRunner("node-a"), dockerd.url)
    tag = _unique("churn")
    names = [f"{tag}-{i}" for i in range(30)]
    for name in names:
        engine.made.append(name)
        engine.containers.create("vrd-test/busybox:1", ["true"], name=name, labels={"t": tag})

    def remove_all() -> None:
        for name in names:
            engine.containers.get(name).remove(force=True)

    with ThreadPoolExecutor(1) as pool:
        removing = pool.submit(remove_all)
        while not removing.done():
            named, labelled = node_docker.list_matching_and_labelled([f"{tag}-*"], {"t": tag})
            assert {c.name for c in named} == {c.name for c in labelled} <= set(names)
            assert {c.name for c in node_docker.list_containers([f"{tag}-*"])} <= set(names)
        removing.result()
    assert node_docker.list_containers([f"{tag}-*"]) == []
    node_docker.close()


def test_run_detached_with_labels_env_logs_wait(node_docker: NodeDocker, engine) -> None:  # type: ignore[no-untyped-def]
    name = _unique("vrd-head")
    engine.made.append(name)
    cluster = _unique("cl")
    container_id = node_docker.run_detached(
        ContainerSpec(
            name=name,
            image="vrd-test/busybox:1",
            command=["sh", "-c", 'echo "ip=$VLLM_HOST_IP"; echo line2 >&2; exit 5'],
            env={"VLLM_HOST_IP": "127.0.0.11"},
            labels=project_labels(cluster, "head"),
            shm_size="64m",
        )
    )
    assert node_docker.wait(name, timeout_s=20) == 5
    mine = node_docker.list_containers(labels={LABEL_CLUSTER: cluster})
    assert [c.id for c in mine] == [container_id]
    assert mine[0].labels["io.vllm-redeploy.role"] == "head" and mine[0].exit_code == 5
    assert mine[0].restart_policy == "no"
    logs = node_docker.logs_tail(name, lines=10)
    assert "ip=127.0.0.11" in logs and "line2" in logs
    attrs = engine.containers.get(name).attrs["HostConfig"]
    assert (attrs["NetworkMode"], attrs["IpcMode"], attrs["ShmSize"]) == (
        "host",
        "host",
        64 * 1024 * 1024,
    )


def test_the_head_of_a_long_log_is_read_without_the_rest(
    node_docker: NodeDocker,
    engine,  # type: ignore[no-untyped-def]
) -> None:
    """A start's lines (NCCL's choice) are at the top of a log that weeks of request lines
    follow: read up to a byte cap, then the stream is closed."""
    name = _unique("chatty")
    engine.made.append(name)
    script = (
        'echo "NCCL INFO Using network IB"; i=0; '
        'while [ $i -lt 20000 ]; do echo "request $i"; i=$((i+1)); done'
    )
    node_docker.run_detached(
        ContainerSpec(name=name, image="vrd-test/busybox:1", command=["sh", "-c", script])
    )
    assert node_docker.wait(name, timeout_s=30) == 0
    head = node_docker.log_head(name, max_bytes=4096)
    assert head.startswith("NCCL INFO Using network IB\nrequest 0\n")
    assert 3500 < len(head) <= 4096 and "request 19999" not in head
    assert "request 19999" in node_docker.log_head(name, max_bytes=1024 * 1024)
    assert node_docker.logs_tail(name, lines=1).strip() == "request 19999"  # the stream closed


def test_wait_returns_none_while_running(node_docker: NodeDocker, engine) -> None:  # type: ignore[no-untyped-def]
    name = _unique("long")
    _autostart(engine, name)
    assert node_docker.wait(name, timeout_s=0.3) is None


def test_exec_runs_argv_in_the_container(node_docker: NodeDocker, engine) -> None:  # type: ignore[no-untyped-def]
    name = _unique("exec")
    _autostart(engine, name)
    runner = node_docker.exec_runner(name)
    result = runner.run(["sh", "-c", 'echo "$A"; echo e >&2'], env={"A": "b c"}, timeout=10)
    assert (result.stdout, result.stderr, result.node) == ("b c\n", "e\n", f"node-a/{name}")
    assert runner.run(["echo", "$(id)"], timeout=10).stdout == "$(id)\n"
    with pytest.raises(CommandFailed):
        runner.run(["false"], timeout=10)


def test_execs_give_their_channels_back(
    ssh_runner: SSHRunner,
    engine,  # type: ignore[no-untyped-def]
) -> None:
    """Each exec streams on a channel of its own (an upgraded HTTP connection): once it ends,
    finished or past its timeout, the channel's place is free again, so the node's plain
    commands never wait behind execs that are over."""
    name = _unique("execs")
    _autostart(engine, name)
    node = node_docker_for(ssh_runner)
    runner = node.exec_runner(name)
    for _ in range(MAX_CHANNELS + 2):
        assert runner.run(["echo", "hi"], timeout=10).stdout == "hi\n"
    for _ in range(MAX_CHANNELS + 2):
        with pytest.raises(CommandTimedOut):
            runner.run(["sh", "-c", "echo a; sleep 0.3; echo b; sleep 5"], timeout=0.2)
    answered = ThreadPoolExecutor(1).submit(ssh_runner.run, ["echo", "free"], timeout=10)
    assert answered.result(timeout=20).stdout == "free\n"
    node.close()


def test_docker_over_ssh_survives_a_dropped_connection(
    ssh_runner: SSHRunner,
    sshd,
    test_image: str,  # type: ignore[no-untyped-def]
) -> None:
    node = node_docker_for(ssh_runner)
    before = node.image_id("vrd-test/busybox:1")
    assert before is not None
    sshd.drop_connections()
    assert node.image_id("vrd-test/busybox:1") == before
    node.close()


def test_an_image_of_another_user_gets_the_cache_handed_to_it(
    node_docker: NodeDocker,
    engine,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """An image whose USER is not root: its user is read from the image, and the one-shot
    container (as root) hands the node's cache directory, made by Docker as root, to it."""
    tag = f"vrd-test/user:{uuid.uuid4().hex[:8]}"
    dockerfile = f"FROM {TEST_IMAGE}\nUSER 1234:1234\n".encode()
    engine.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True)
    try:
        assert node_docker.image_user(tag) == "1234:1234"
        assert node_docker.image_user(TEST_IMAGE) == ""
        cache = tmp_path / "cache"  # missing: Docker makes it for the mount, as root
        config = cache_config(tag, cache)
        assert cache_owner(config, "") is None and cache_owner(config, "root:root") is None
        owner = cache_owner(config, node_docker.image_user(tag))
        assert owner == "1234:1234"
        code, output = node_docker.run_to_completion(own_cache_spec(config, owner), 60)
        assert code == 0, output
        assert (cache.stat().st_uid, cache.stat().st_gid) == (1234, 1234)
        assert node_docker.get(own_cache_spec(config, owner).name) is None  # removed after
    finally:
        engine.images.remove(tag, force=True)


def cache_config(image: str, cache: Path) -> ClusterConfig:
    return ClusterConfig(  # type: ignore[call-arg]
        _env_file=None,
        name="ops",
        nodes=[{"name": "node-a", "address": "127.0.0.1"}],
        vllm={"image": image, "model": "/models/none"},
        cache={"dir": str(cache)},
    )


def test_a_call_the_engine_never_answers_says_so_in_words(tmp_path: Path) -> None:
    """A Docker engine that accepts a call and never answers (stuck, or swamped): the call
    ends at the client's timeout with words, not "unexpected error" (issue 50, item 6). The
    engine here is a socket that accepts and stays silent; the client's timeout is 1 s."""
    path = tmp_path / "stuck.sock"
    with socket.socket(socket.AF_UNIX) as stuck:
        stuck.bind(str(path))
        stuck.listen()
        client = docker.DockerClient(base_url=f"unix://{path}", version="1.44", timeout=1)
        node = NodeDocker("node-2", client)
        with pytest.raises(DockerError) as raised:
            node.version()
    assert str(raised.value).startswith(
        "Docker on node-2: version got no answer within 1 s: its engine is stuck or overloaded"
    ), raised.value
    assert not raised.value.transient
