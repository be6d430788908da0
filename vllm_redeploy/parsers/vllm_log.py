"""What the vLLM engine's log says about loading."""

from __future__ import annotations

import re
from dataclasses import dataclass

# "Loading safetensors checkpoint shards:  45% Completed | 18/40 [03:01<03:40, ...]"
_SHARDS = re.compile(r"Loading safetensors checkpoint shards:\s*(\d+)% Completed \|\s*(\d+)/(\d+)")


@dataclass(frozen=True)
class LoadProgress:
    percent: int
    done: int
    total: int


def last_load_progress(text: str) -> LoadProgress | None:
    """The latest shard-loading progress in a log excerpt, if any."""
    matches = _SHARDS.findall(text)
    if not matches:
        return None
    percent, done, total = matches[-1]
    return LoadProgress(int(percent), int(done), int(total))


# NCCL's INFO lines (on by default so the transport can be proven) would fill any tail of the
# engine's log; people reading why a load failed want vLLM's own lines and NCCL's warnings.
_NCCL_INFO = re.compile(r"\bNCCL INFO\b")
# Python's warnings ("/path/x.py:138: FutureWarning: ..." and the indented source line after it):
# the real engine prints a few at every start, enough to push its own lines out of a short tail.
_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")


def tail_for_people(text: str, lines: int) -> str:
    """The last ``lines`` lines of a log, NCCL's INFO lines and Python's warnings left out."""
    kept: list[str] = []
    after_warning = False
    for line in text.splitlines():
        if after_warning and line.startswith(" "):
            after_warning = False
            continue
        after_warning = bool(_PY_WARNING.match(line))
        if not after_warning and not _NCCL_INFO.search(line):
            kept.append(line)
    return "\n".join(kept[-lines:])


# vLLM's own words (vllm/compilation) for a start that found its compiled graphs in the cache,
# for one that compiled them, and for a cache that was turned off.
_LOADED = re.compile(r"Directly load (?:AOT compilation from path|the compiled graph\(s\))")
_COMPILED = re.compile(
    r"Compiling a graph for compile range|saved AOT compiled function to|Compiling model again"
)
_DISABLED = re.compile(r"vLLM's torch\.compile cache is disabled")
# A cached function the engine could not load (seen on 0.32.0's CPU build): it compiles again.
_LOAD_FAILED = re.compile(r"Compiling model again due to a load failure from \S+, reason: (.*)")
_TOTAL = re.compile(
    r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total"
)


@dataclass(frozen=True)
class CompileCache:
    """What the engine's log says of torch.compile at this start."""

    state: str  # "warm" (loaded from the cache), "cold" (compiled), "disabled"
    compile_s: float | None  # "torch.compile took S s in total", when it says
    unloadable: str | None = None  # why the cached function could not be loaded

    def summary(self) -> str:
        took = f", torch.compile {self.compile_s:.1f} s" if self.compile_s is not None else ""
        if self.unloadable:
            took += f"; the cached one could not be loaded: {self.unloadable}"
        words = {
            "warm": "warm (compiled graphs loaded from the cache",
            "cold": "cold (graphs compiled and saved for the next start",
            "disabled": "off (vLLM's torch.compile cache is disabled",
        }
        return f"{words[self.state]}{took})"


def compile_cache_state(text: str) -> CompileCache | None:
    """Warm, cold or disabled, from an engine log; None when it never compiled (eager mode)."""
    if _DISABLED.search(text):
        state = "disabled"
    elif _COMPILED.search(text):  # one graph compiled means the start paid for compiling
        state = "cold"
    elif _LOADED.search(text):
        state = "warm"
    else:
        return None
    totals = _TOTAL.findall(text)
    failed = _LOAD_FAILED.search(text)
    return CompileCache(
        state,
        sum(float(t) for t in totals) if totals else None,
        failed.group(1).strip()[:200] if failed else None,
    )
