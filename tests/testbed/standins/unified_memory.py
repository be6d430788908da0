"""vLLM's memory on a unified-memory node (GB10), for the vLLM stand-in.

On a DGX Spark the GPU allocates from system memory. With ``VRD_UNIFIED_MEMORY=1`` and a memory
model for the node (tests.testbed.memory, next to its GPU state), each rank

- refuses to start as vLLM does when the node's free memory is below --gpu-memory-utilization x
  the GPU's total, free memory as the claimed vLLM version reads it (:func:`free_field`);
- while loading adds its share of the weights to the node's page cache (reading safetensors;
  not with InstantTensor's direct I/O) and to what it holds, then holds utilization x total
  for the KV cache, until it exits or dies;
- dies by SIGKILL when nothing can make room for an allocation (the kernel's OOM killer).

Ray's memory monitor is Ray's own: the bed's containers see their node's /proc/meminfo.
Standard library only, as the stand-in.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from tests.testbed import memory

ENV = "VRD_UNIFIED_MEMORY"
CONTEXT_KIB = 512 * 1024  # CUDA context and PyTorch, before any weight
WARMUP_S = 0.6  # profiling, KV cache, CUDA graphs: longer than two rounds of Ray's monitor
KIB_PER_MIB = 1024


def node_memory(gpu_state_dir: str | None) -> memory.NodeMemory | None:
    """The node's memory if the bed models it and the GPU allocates from it."""
    if not gpu_state_dir:
        return None
    node = memory.NodeMemory(gpu_state_dir)
    return node if node.exists() and node.unified else None


def free_memory_message(free_mib: float, total_mib: int, want_mib: int, util: float) -> str:
    gib = 1024.0
    return (
        f"Free memory on device ({round(free_mib / gib, 2)}/{round(total_mib / gib, 2)} GiB) on "
        f"startup is less than desired GPU memory utilization ({util}, "
        f"{round(want_mib / gib, 2)} GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes."
    )


def free_field(version: str) -> str:
    """Which /proc/meminfo figure the vLLM ``version`` takes for the GPU's free memory on a GB10.

    Before 0.17, CUDA's own figure (cudaMemGetInfo), which leaves the page cache out: MemFree.
    0.17 to 0.19 read MemAvailable on compute capability 12.1, and later versions on any
    integrated GPU (``is_integrated_gpu``): the page cache counts as free. vllm#48140 reports
    MemFree again on 0.24; no fix is known, so 0.24 and later read MemFree, the harder rule.
    """
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    return "MemAvailable" if (0, 17) <= parts < (0, 24) else "MemFree"


def shortfall(
    node: memory.NodeMemory, want_mib: int, total_mib: int, util: float, version: str
) -> str | None:
    """vLLM's refusal when the free memory it reads (:func:`free_field`) is below what it
    wants."""
    free_kib = node.available_kib() if free_field(version) == "MemAvailable" else node.free_kib()
    free_mib = free_kib / KIB_PER_MIB
    if free_mib >= want_mib:
        return None
    return free_memory_message(free_mib, total_mib, want_mib, util)


def or_oom_kill(allocate: Callable[[], None]) -> None:
    try:
        allocate()
    except memory.OutOfMemory:
        os.kill(os.getpid(), signal.SIGKILL)


class UnifiedLoad:
    """One rank's memory while vLLM starts on a unified-memory node."""

    def __init__(self, node: memory.NodeMemory, name: str, weights_kib: int, want_kib: int) -> None:
        self.node, self.weights_kib, self.want_kib = node, weights_kib, want_kib
        self.holding = node.hold(name, CONTEXT_KIB)

    def shard(self, shards: int, cached: bool = True) -> None:
        """One of ``shards`` safetensors files read: its pages cached (not with direct I/O,
        as InstantTensor reads), its tensors held."""
        part = self.weights_kib // shards

        def read() -> None:
            if cached:
                self.node.add_cache(part)
            self.holding.grow(part)

        or_oom_kill(read)

    def kv_cache(self) -> None:
        """Profile, allocate the KV cache up to the utilization, capture CUDA graphs."""
        or_oom_kill(lambda: self.holding.resize(max(self.want_kib, self.holding.kib)))
        time.sleep(WARMUP_S)
