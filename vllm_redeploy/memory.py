"""A node's memory as vLLM will see it, and the holders of the rest. No Prefect here.

On unified memory (DGX Spark's GB10) the GPU allocates from system RAM, and vLLM checks at start
that the free memory (``cudaMemGetInfo``: free pages, NOT reclaimable page cache) covers
``gpu_memory_utilization`` of the total: a node whose page cache is full from the last load
passes a ``MemAvailable`` check and then vLLM refuses to start (vllm#35313). So the judgement
uses ``MemFree``, after the cache is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MEMINFO_ARGV: tuple[str, ...] = ("cat", "/proc/meminfo")
# The biggest processes by resident memory, for a person to act on.
TOP_MEMORY_ARGV: tuple[str, ...] = ("ps", "-eo", "pid,rss,comm", "--sort=-rss", "--no-headers")
# What a one-shot container writes to drop the page cache (clean pages only: nothing is lost).
DROP_CACHES = "/proc/sys/vm/drop_caches"
DROP_SCRIPT = "sync && echo 3 > /drop_caches"
GIB = 1024 * 1024  # kiB
_LINE = re.compile(r"^([A-Za-z()_]+):\s+(\d+)(?: kB)?$", re.MULTILINE)


@dataclass(frozen=True)
class Meminfo:
    total_kib: int
    free_kib: int
    available_kib: int
    cached_kib: int

    @property
    def free_gib(self) -> float:
        return self.free_kib / GIB


def parse_meminfo(text: str) -> Meminfo | None:
    """The fields of /proc/meminfo this judgement uses; None when they are not there."""
    values = {k: int(v) for k, v in _LINE.findall(text)}
    try:
        return Meminfo(
            values["MemTotal"],
            values["MemFree"],
            values.get("MemAvailable", values["MemFree"]),
            values.get("Cached", 0) + values.get("Buffers", 0),
        )
    except KeyError:
        return None


@dataclass(frozen=True)
class MemoryHolder:
    pid: int
    rss_kib: int
    name: str


def parse_top_memory(text: str, count: int = 3) -> list[MemoryHolder]:
    holders = []
    for line in text.splitlines():
        fields = line.split(None, 2)
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit():
            holders.append(MemoryHolder(int(fields[0]), int(fields[1]), fields[2].strip()))
    return holders[:count]


def needed_kib(meminfo: Meminfo, utilization: float | None) -> int:
    """What vLLM asks to find free at start: gpu_memory_utilization (its default 0.9) of all."""
    return int(meminfo.total_kib * (utilization if utilization is not None else 0.9))
