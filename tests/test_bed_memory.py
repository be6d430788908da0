"""The bed as hard as a DGX Spark for memory, and a filesystem of each node's own.

One gb10 bed for the module. Each node's sshd and dockerd run in the node's mount namespace
(tests.testbed.namespace): its own /etc, its /proc/meminfo rendered from its memory model
(tests.testbed.memory), its drop_caches. Everything is driven the way the product drives a node:
real SSH, the node's Docker through it, and the product's own Ray and engine container specs.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import make_bed
from tests.testbed import image
from tests.testbed.bed import TestBed
from tests.testbed.memory import BOOT
from tests.testbed.procs import free_port, wait_until
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.gpus import inspect_gpus
from vllm_redeploy.launch.group import engine_container, model_mounts, node_env
from vllm_redeploy.launch.ray import (
    engine_spec,
    parse_members,
    ray_container,
    ray_members_argv,
    ray_spec,
    ray_volume,
)
from vllm_redeploy.nodes import ContainerSpec, NodeAccess, NodeDocker

pytestmark = pytest.mark.integration

GIB = 1024 * 1024  # KiB
DROP_BIND = "/proc/sys/vm/drop_caches:/drop_caches"
DROP_SCRIPT = "sync; echo 3 > /drop_caches"
STARTED = "Application startup complete."
# A 6.18 kernel's /proc/meminfo (this development VM's), as an arm64 box prints it: CMA, no
# x86-only DirectMap lines, no VM balloon.
MEMINFO_KEYS = [
    "MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "SwapCached", "Active",
    "Inactive", "Active(anon)", "Inactive(anon)", "Active(file)", "Inactive(file)", "Unevictable",
    "Mlocked", "SwapTotal", "SwapFree", "Zswap", "Zswapped", "Dirty", "Writeback", "AnonPages",
    "Mapped", "Shmem", "KReclaimable", "Slab", "SReclaimable", "SUnreclaim", "KernelStack",
    "PageTables", "SecPageTables", "NFS_Unstable", "Bounce", "WritebackTmp", "CommitLimit",
    "Committed_AS", "VmallocTotal", "VmallocUsed", "VmallocChunk", "Percpu", "AnonHugePages",
    "ShmemHugePages", "ShmemPmdMapped", "FileHugePages", "FilePmdMapped", "CmaTotal", "CmaFree",
    "HugePages_Total", "HugePages_Free", "HugePages_Rsvd", "HugePages_Surp", "Hugepagesize",
    "Hugetlb",
]  # fmt: skip


@pytest.fixture(scope="module")
def bed() -> Iterator[TestBed]:
    testbed = make_bed(2, "gb10", first_ip=241)
    yield testbed
    testbed.down()


@pytest.fixture(scope="module")
def config(bed: TestBed) -> ClusterConfig:
    return load_config(bed.config_path, env_file=None)


@pytest.fixture
def access(config: ClusterConfig) -> Iterator[dict[str, NodeAccess]]:
    nodes = {n.name: NodeAccess(n, config) for n in config.nodes}
    yield nodes
    for node in nodes.values():
        node.close()


@pytest.fixture(autouse=True)
def empty_caches(bed: TestBed) -> None:
    """Each test starts without another's page cache."""
    for node in bed.nodes:
        node.memory.drop_caches(3)


def meminfo(node: NodeAccess) -> dict[str, int]:
    """/proc/meminfo as the node's login shell reads it, in KiB."""
    text = node.runner.run(["cat", "/proc/meminfo"], timeout=10).stdout
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in text.splitlines())}


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------- meminfo


def test_meminfo_over_ssh_is_the_nodes_own(bed: TestBed, access: dict[str, NodeAccess]) -> None:
    bed.node("node-1").memory.fill_cache(8)
    for node in bed.nodes:
        text = access[node.name].runner.run(["cat", "/proc/meminfo"], timeout=10).stdout
        assert text == node.memory.meminfo()
    one, two = meminfo(access["node-1"]), meminfo(access["node-2"])
    assert one["Cached"] - two["Cached"] == 8 * GIB
    assert list(one) == MEMINFO_KEYS
    assert one["SwapTotal"] == 0 and one["MemTotal"] == two["MemTotal"] == 127_535_084
    assert one["MemFree"] == (
        one["MemTotal"]
        - bed.node("node-1").memory.used_kib()
        - (one["SReclaimable"] + one["SUnreclaim"] + one["KernelStack"] + one["PageTables"])
        - BOOT["gb10"].reserved_kib  # outside any field (firmware, driver carve-outs)
        - one["Cached"]
        - one["Buffers"]
    )


def test_after_boot_a_spark_has_about_101_gib_available(
    bed: TestBed, access: dict[str, NodeAccess]
) -> None:
    bed.reboot("node-2")
    report = inspect_gpus("node-2", access["node-2"].runner)
    assert report.unified_memory and report.clear
    assert report.mem_total_mib == 127_535_084 // 1024
    assert report.mem_available_mib is not None
    assert 101 <= report.mem_available_mib / 1024 <= 102


def test_page_cache_lowers_memfree_not_memavailable(
    bed: TestBed, access: dict[str, NodeAccess]
) -> None:
    before = meminfo(access["node-1"])
    bed.node("node-1").memory.fill_cache(30)
    after = meminfo(access["node-1"])
    assert before["MemFree"] - after["MemFree"] == 30 * GIB
    assert abs(before["MemAvailable"] - after["MemAvailable"]) < GIB // 10
    assert after["Active(file)"] + after["Inactive(file)"] > 30 * GIB


def test_a_stray_gpu_process_holds_node_memory_until_it_dies(
    bed: TestBed, access: dict[str, NodeAccess]
) -> None:
    node, runner = bed.node("node-2"), access["node-2"].runner
    before = meminfo(access["node-2"])["MemAvailable"]
    holder = node.hold_gpu(20_000, "python3")
    try:
        assert before - meminfo(access["node-2"])["MemAvailable"] == 20_000 * 1024
        query = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                 "--format=csv,noheader,nounits"]  # fmt: skip
        assert runner.run(query, timeout=10).stdout == f"{holder.pid}, python3, 20000\n"
    finally:
        holder.kill()
        holder.wait()
    available = lambda: meminfo(access["node-2"])["MemAvailable"]  # noqa: E731
    wait_until(lambda: available() == before, 5, "the memory back once the process died")


# --------------------------------------------------------------------------- drop_caches


def drop_spec(config: ClusterConfig, image_kind: str) -> ContainerSpec:
    """The one-shot container that drops a node's page cache: the node's drop_caches
    bind-mounted, root in the container, no --privileged. Any image with sh and sync does; the
    bed's vLLM image needs the configured volumes for its /usr."""
    if image_kind == "busybox":
        tag, volumes = image.OLD_STACK_IMAGE, [DROP_BIND]
    else:
        tag, volumes = config.vllm.image, [*config.vllm.volumes, DROP_BIND]
    return ContainerSpec(
        name=name("drop-caches"),
        image=tag,
        entrypoint=["sh"],
        command=["-c", DROP_SCRIPT],
        volumes=volumes,
    )


def drop_caches(node: NodeAccess, config: ClusterConfig, image_kind: str = "busybox") -> None:
    code, log = node.docker.run_to_completion(drop_spec(config, image_kind), timeout_s=30)
    assert (code, log) == (0, "")


@pytest.mark.parametrize("image_kind", ["busybox", "vllm-image"])
def test_the_drop_caches_container_empties_the_page_cache(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig, image_kind: str
) -> None:
    memory = bed.node("node-1").memory
    memory.fill_cache(40)
    other = bed.node("node-2").memory.cached_kib()
    before = meminfo(access["node-1"])
    drop_caches(access["node-1"], config, image_kind)
    wait_until(lambda: memory.cached_kib() < GIB, 5, "node-1's page cache dropped")
    after = meminfo(access["node-1"])
    assert after["MemFree"] - before["MemFree"] > 40 * GIB
    assert bed.node("node-2").memory.cached_kib() == other  # the other node's is its own


def test_without_the_bind_mount_proc_sys_is_read_only(
    access: dict[str, NodeAccess], config: ClusterConfig
) -> None:
    spec = ContainerSpec(
        name=name("no-drop"),
        image=image.OLD_STACK_IMAGE,
        entrypoint=["sh"],
        command=["-c", "echo 3 > /proc/sys/vm/drop_caches"],
    )
    code, log = access["node-1"].docker.run_to_completion(spec, timeout_s=30)
    assert code == 1 and "Read-only file system" in log


# --------------------------------------------------------------------------- filesystem


def test_each_node_has_a_private_etc_that_survives_a_reboot(
    bed: TestBed, access: dict[str, NodeAccess]
) -> None:
    marker = f"vrd-{uuid.uuid4().hex[:8]}"
    one, two = access["node-1"].runner, access["node-2"].runner
    script = f"echo node-1 > /etc/{marker}; touch /usr/local/{marker}"
    one.run(["sudo", "-n", "sh", "-c", script], timeout=10)  # the login is not root
    assert two.run(["cat", f"/etc/{marker}"], timeout=10, check=False).exit_code == 1
    assert not Path("/etc", marker).exists() and not Path("/usr/local", marker).exists()
    bed.node("node-1").memory.fill_cache(10)
    bed.reboot("node-1")
    assert one.run(["cat", f"/etc/{marker}"], timeout=10).stdout == "node-1\n"
    assert meminfo(access["node-1"])["Cached"] == BOOT["gb10"].cached_kib  # as after a boot


def test_tools_and_docker_over_ssh_run_in_the_nodes_view(
    bed: TestBed, access: dict[str, NodeAccess]
) -> None:
    node = bed.node("node-2")
    script = (
        "ip route get 127.0.0.1 >/dev/null && ss -ltn | grep -c LISTEN >/dev/null && "
        "nvidia-smi -L && systemctl is-active glm-server.service && "
        "docker info --format '{{.MemTotal}}' && docker ps --format '{{.Names}}' | sort"
    )
    out = access["node-2"].runner.run(["sh", "-c", script], timeout=30).stdout.splitlines()
    assert out[0].startswith("GPU 0: NVIDIA GB10") and out[1] == "active"
    assert int(out[2]) == node.memory.total_kib() * 1024  # dockerd reads the node's meminfo
    assert out[3:] == ["glm-proxy", "glm-server"]
    assert access["node-2"].docker.get("glm-proxy") is not None  # the SDK through SSH


# --------------------------------------------------------------------------- vLLM on one node


def standin_spec(
    config: ClusterConfig, util: float, version: str = "0.24.0"
) -> tuple[ContainerSpec, str]:
    """`vllm serve` on node-1 alone (TP=1, no Ray), with the bed's settings, claiming
    ``version`` (by default one that reads MemFree: the page cache is not free)."""
    node = config.nodes[0]
    port = str(free_port(node.ip))
    serve = ["serve", config.vllm.source.serve, "--host", node.ip, "--port", port,
             "--gpu-memory-utilization", str(util)]  # fmt: skip
    spec = ContainerSpec(
        name=name("vllm-one"),
        image=config.vllm.image,
        entrypoint=["vllm"],
        command=serve,
        env={**node_env(node, config), "VRD_LOAD_SECONDS": "1", "VRD_VLLM_VERSION": version},
        volumes=model_mounts(config),
    )
    return spec, f"http://{node.ip}:{port}"


def wait_started_or_exited(docker: NodeDocker, container: str) -> str:
    def done() -> bool:
        info = docker.get(container)
        return info is None or not info.running or STARTED in docker.logs_tail(container, 400)

    wait_until(done, 60, f"{container} serving or gone")
    return docker.logs_tail(container, 400)


def test_vllm_refuses_while_page_cache_holds_memory_and_starts_after_a_drop(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig
) -> None:
    memory, docker = bed.node("node-1").memory, access["node-1"].docker
    memory.fill_cache(35)  # the last model load's files
    free_gib = round(meminfo(access["node-1"])["MemFree"] / GIB, 2)
    spec, _ = standin_spec(config, 0.75)
    code, log = docker.run_to_completion(spec, timeout_s=60)
    assert code == 1
    assert (
        f"ValueError: Free memory on device ({free_gib}/121.69 GiB) on startup is less than "
        "desired GPU memory utilization (0.75, 91.27 GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes."
    ) in log
    drop_caches(access["node-1"], config)
    wait_until(lambda: memory.cached_kib() < GIB, 5, "page cache dropped")
    spec, _ = standin_spec(config, 0.75)
    docker.run_detached(spec)
    try:
        assert STARTED in wait_started_or_exited(docker, spec.name)
        loaded = memory.usage()
        # The weights' pages fill what is left; the kernel reclaimed the rest.
        assert loaded.cached_kib > 5 * GIB and loaded.free_kib < GIB
        held = loaded.used_kib - sum(loaded.state.used.values())
        assert held == int(0.75 * 124_610 * 1024)  # utilization x total, for the KV cache
    finally:
        docker.remove(spec.name)
    # The process is gone: the node's watcher shows its memory back.
    wait_until(lambda: memory.usage().held == {}, 5, "the engine's memory released")
    assert meminfo(access["node-1"])["MemAvailable"] > 100 * GIB


def test_instanttensor_reads_past_the_page_cache_and_a_missing_loader_fails_the_load(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig
) -> None:
    """InstantTensor's direct I/O leaves the node's page cache as it was (the default loader's
    run above fills it); a loader the image's Python lacks fails as vLLM fails it."""
    memory, docker = bed.node("node-1").memory, access["node-1"].docker
    drop_caches(access["node-1"], config)
    wait_until(lambda: memory.cached_kib() < GIB, 5, "page cache dropped")
    spec, _ = standin_spec(config, 0.75)
    spec = replace(
        spec, image=image.LOADERS_IMAGE, command=[*spec.command, "--load-format", "instanttensor"]
    )
    docker.run_detached(spec)
    try:
        log = wait_started_or_exited(docker, spec.name)
        assert STARTED in log and "Loading safetensors using InstantTensor loader: 100%" in log
        loaded = memory.usage()
        assert loaded.cached_kib < GIB, loaded  # nothing of the weights went through it
        held = loaded.used_kib - sum(loaded.state.used.values())
        assert held == int(0.75 * 124_610 * 1024)  # the weights and the KV cache, as before
    finally:
        docker.remove(spec.name)
    spec, _ = standin_spec(config, 0.75)  # the bed's own image: no fast loader in its Python
    spec = replace(spec, command=[*spec.command, "--load-format", "fastsafetensors"])
    code, log = docker.run_to_completion(spec, timeout_s=60)
    assert code == 1 and "in fastsafetensors_weights_iterator" in log
    assert (
        "ImportError: Please install fastsafetensors via `pip install vllm[fastsafetensors]`" in log
    )


@pytest.mark.parametrize(
    ("version", "reads"),
    [
        ("0.16.0", "MemFree"),
        ("0.17.1", "MemAvailable"),
        ("0.23.1", "MemAvailable"),
        ("0.24.0", "MemFree"),
    ],
)
def test_what_vllm_counts_as_free_depends_on_its_version(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig, version: str, reads: str
) -> None:
    """The same node full of page cache: versions that read MemAvailable (0.17 to 0.23) start,
    the others refuse, quoting MemFree."""
    memory, docker = bed.node("node-1").memory, access["node-1"].docker
    memory.fill_cache(35)
    try:
        found = meminfo(access["node-1"])
        assert found["MemFree"] < 0.75 * 121.69 * GIB < found["MemAvailable"]
        spec, _ = standin_spec(config, 0.75, version)
        docker.run_detached(spec)
        log = wait_started_or_exited(docker, spec.name)
        if reads == "MemAvailable":
            assert STARTED in log, log
        else:
            assert docker.wait(spec.name, 10) == 1, log
            free_gib = round(found["MemFree"] / GIB, 2)
            assert f"Free memory on device ({free_gib}/121.69 GiB) on startup" in log, log
    finally:
        docker.remove(spec.name)
        drop_caches(access["node-1"], config)
        wait_until(lambda: memory.usage().held == {}, 5, "the engine's memory released")


# --------------------------------------------------------------------------- Ray's memory monitor


@contextlib.contextmanager
def ray_cluster(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig, env: dict[str, str]
) -> Iterator[ClusterConfig]:
    """The product's Ray containers on both nodes at utilization 0.8: vLLM's check passes
    (MemFree 100.2 of 121.7 GiB after boot), then the KV cache takes the nodes to 96.5%. The
    API port is one of its own (the old stack's server holds the usual one)."""
    changes = {
        "gpu_memory_utilization": 0.8,
        "env": {**config.vllm.env, **env},
        "port": free_port(config.head.ip),
    }
    vllm = config.vllm.model_copy(update=changes)
    cluster = config.model_copy(update={"name": name("mem"), "vllm": vllm})
    head = access[cluster.head.name].docker
    try:
        for node in cluster.nodes:
            access[node.name].docker.run_detached(ray_spec(node, cluster))
        members = head.exec_runner(ray_container(cluster))

        def formed() -> bool:
            found = members.run(ray_members_argv(cluster), timeout=30, check=False).stdout
            return len([m for m in parse_members(found) if m.alive]) == len(cluster.nodes)

        wait_until(formed, 60, "the Ray cluster")
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            head.remove(engine_container(cluster))
        for node in cluster.nodes:
            with contextlib.suppress(Exception):
                access[node.name].docker.remove(ray_container(cluster))
        with (
            contextlib.closing(bed.node(cluster.head.name).engine.client()) as client,
            contextlib.suppress(Exception),
        ):
            client.volumes.get(ray_volume(cluster)).remove(force=True)


def test_ray_kills_a_rank_when_the_node_passes_95_percent(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig
) -> None:
    on = {"RAY_memory_monitor_refresh_ms": "250"}  # Ray's default, whatever the product's
    with ray_cluster(bed, access, config, on) as cluster:
        head = access[cluster.head.name].docker
        head.run_detached(engine_spec(cluster))
        code = head.wait(engine_container(cluster), 60)
        log = head.logs_tail(engine_container(cluster), 400)
    assert code == 1, log[-3000:]
    assert (
        "ray.exceptions.OutOfMemoryError: 1 worker(s) were killed due to the node running low "
        "on memory. Memory on the node (IP: 127.0." in log
    )
    assert "GB limit (0.96" in log and "exceeded threshold of" in log
    assert "(95.0% of 130595926016B limit)" in log
    assert "EngineCore failed to start." in log
    assert "RuntimeError: Engine core initialization failed." in log


def test_with_ray_memory_monitor_off_the_rank_lives(
    bed: TestBed, access: dict[str, NodeAccess], config: ClusterConfig
) -> None:
    off = {"RAY_memory_monitor_refresh_ms": "0"}
    with ray_cluster(bed, access, config, off) as cluster:
        head = access[cluster.head.name].docker
        head.run_detached(engine_spec(cluster))
        log = wait_started_or_exited(head, engine_container(cluster))
        assert STARTED in log and "OutOfMemoryError" not in log
        for node in cluster.nodes:
            info = meminfo(access[node.name])
            assert 1 - info["MemAvailable"] / info["MemTotal"] > 0.95
