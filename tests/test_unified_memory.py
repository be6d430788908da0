"""Unified memory, end to end (issue 14): on GB10 nodes the GPU allocates from system RAM, and vLLM
refuses to start when free memory (page cache not counted) is short. The bed's nodes have their
own /proc/meminfo and drop_caches (tests/testbed/memory.py, a mount namespace per node).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.testbed.bed import TestBed
from tests.testbed.image import REPO
from vllm_redeploy.nodes.containers import LABEL_MANAGED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
FAST = {"VRD_LOAD_SECONDS": "1"}
GIB = 1024 * 1024  # kiB


@pytest.fixture(scope="module")
def gb10_bed(prefect_api: str) -> Iterator[TestBed]:
    bed = make_bed(2, "gb10", first_ip=195)
    yield bed
    bed.down()


@pytest.fixture(autouse=True)
def no_group_left(gb10_bed: TestBed) -> Iterator[None]:
    yield
    for node in gb10_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True, filters={"label": LABEL_MANAGED}):
                c.remove(force=True)


def test_a_node_full_of_page_cache_is_dropped_and_served(gb10_bed: TestBed) -> None:
    """What the last load left: a page cache that keeps MemFree below what vLLM asks for, while
    MemAvailable (which counts the cache) looks fine."""
    for node in gb10_bed.nodes:
        node.memory.fill_cache(60)
        assert node.memory.free_kib() < 0.75 * node.memory.total_kib()  # vLLM would refuse
    path = gb10_bed.write_config(gb10_bed.root / "cache.toml", vllm={"env": FAST})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    summary = state.result()["summary"]
    for node in gb10_bed.nodes:
        row = next(line for line in summary.splitlines() if line.startswith(f"| {node.name} |"))
        assert "page cache dropped, MemFree " in row and "vLLM asks 91.2 GiB" in row, row


def test_without_dropping_the_cache_vllm_refuses(gb10_bed: TestBed) -> None:
    """The same node with [memory] drop_page_cache = false: the run fails before anything
    starts, saying what vLLM would ask and who holds the memory."""
    for node in gb10_bed.nodes:
        node.memory.fill_cache(60)
    path = gb10_bed.write_config(
        gb10_bed.root / "nodrop.toml", vllm={"env": FAST}, memory={"drop_page_cache": False}
    )
    state = redeploy_vllm_cluster(str(path), return_state=True)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and message.startswith("memory: node-"), message
    assert "but vLLM will ask for 91.2 GiB (gpu_memory_utilization 0.75 of 121.6 GiB)" in message
    for node in gb10_bed.nodes:
        node.memory.drop_caches(3)


@pytest.fixture
def hog(gb10_bed: TestBed) -> Iterator[subprocess.Popen[str]]:
    """A process on node-1 (no GPU) that holds 60 GiB of the node's memory, and 3 GiB of this
    machine's for real, so `ps` lists it first, as it would on the node. The bed's nodes see
    this machine's processes: with 600 MB, a real vLLM's CPU workers (1.6 GiB each) started by
    a test on another worker came before it."""
    node = gb10_bed.nodes[0]
    program = gb10_bed.root / "mem-hog"
    with contextlib.suppress(FileExistsError):
        program.symlink_to(sys.executable)
    code = textwrap.dedent(
        f"""
        import sys, time
        from tests.testbed.memory import NodeMemory
        held = NodeMemory({str(node.gpu_dir)!r}).hold("mem-hog", 60 * {GIB})
        ballast = bytearray(3 * 1024 * 1024 * 1024)
        for i in range(0, len(ballast), 4096):
            ballast[i] = 1
        print("holding", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [str(program), "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    yield proc
    proc.kill()
    proc.wait()


def test_too_little_memory_fails_before_the_launch_naming_the_holder(
    gb10_bed: TestBed, hog: subprocess.Popen[str]
) -> None:
    path = gb10_bed.write_config(gb10_bed.root / "hog.toml", vllm={"env": FAST})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed(), message
    assert message.startswith("memory: node-1 has ") and "after dropping the page cache" in message
    assert f"The largest memory holders: mem-hog (PID {hog.pid}, " in message, message
    assert "Stop what is not needed there, or lower vllm.gpu_memory_utilization" in message
    for node in gb10_bed.nodes:  # nothing was started
        with contextlib.closing(node.engine.client()) as client:
            assert client.containers.list(all=True, filters={"label": LABEL_MANAGED}) == []
