"""The real vLLM's first and second start, with and without the compile cache ([cache]).

vLLM 0.32.0's CPU build (scripts/real-vllm.sh) with the tiny model, on a 2-node bed with the mp
backend, as tests/test_real_vllm.py runs it but with torch.compile on (no ``--enforce-eager``):
that is where a start spends time the cache can save. Each pair of starts is two redeploys in a
row: first with ``[cache] enabled = false`` (the bed's very first start pays for the page cache
too, so it is not the cached pair's), then with the cache on, from an empty directory. A start's
figures come from its run: ``wait-ready`` (the engine container's start to /v1/models naming the
model), ``probe`` (the first chat completion: the CPU build compiles kernels at the first request
too) and what the summary says of the cache.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.redeploy import redeploy_vllm_cluster
from tests.testbed import real_vllm
from tests.testbed.bed import TestBed

NO_EAGER = ["--max-model-len", "1024", "--max-num-seqs", "1"]  # real_vllm.settings, compiled
_STATE = re.compile(r"this start: (\w+)")


@dataclass(frozen=True)
class Start:
    cache: bool  # [cache] enabled
    nth: int  # 1: the first start (an empty cache, or none); 2: the one after it
    wall_s: float  # the whole redeploy
    ready_s: float  # wait-ready
    first_answer_s: float  # the probe
    said: str  # what the summary says of the compile cache at this start

    @property
    def state(self) -> str:
        found = _STATE.search(self.said)
        return found[1] if found else "–"


@dataclass
class CacheStarts:
    starts: list[Start] = field(default_factory=list)
    skipped: str | None = None  # why the real engine was not measured

    def get(self, cache: bool, nth: int) -> Start | None:
        return next((s for s in self.starts if s.cache == cache and s.nth == nth), None)


def real_engine_starts(root: Path, first_ip: int, say: Any) -> CacheStarts:
    if (why := real_vllm.missing()) is not None:
        return CacheStarts(skipped=why)
    found = CacheStarts()
    bed = TestBed.up(2, "h200", root, first_ip=first_ip, vllm_image=real_vllm.IMAGE)
    try:
        cache = root / "compile-cache"
        shutil.rmtree(cache, ignore_errors=True)
        for enabled in (False, True):
            config = bed.write_config(
                root / f"cache-{enabled}.toml",
                name="realcache",
                vllm={"extra_args": NO_EAGER},
                cache={"enabled": enabled, "dir": str(cache)},
            )
            for nth in (1, 2):
                found.starts.append(_start(config, enabled, nth))
                say(f"real engine, cache {'on' if enabled else 'off'}, start {nth} done")
    finally:
        bed.down()
    return found


def _start(config: Path, cache: bool, nth: int) -> Start:
    started = time.monotonic()
    state = redeploy_vllm_cluster(str(config), "redeploy", return_state=True)
    wall = time.monotonic() - started
    if not state.is_completed():
        raise RuntimeError(f"the real engine's start (cache {cache}, {nth}) ended {state.type}")
    result = state.result()
    steps = result["steps"]
    return Start(
        cache, nth, wall, steps["wait-ready"], steps["probe"], result.get("compile_cache") or ""
    )
