"""What the vLLM engine's log says about loading."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Each loader's tqdm bar, with vLLM's bar_format ("{desc}: {percentage:3.0f}% Completed |
# {n_fmt}/{total_fmt} [...]"), as vllm/model_executor/model_loader/weight_utils.py writes it:
#   Loading safetensors checkpoint shards:  45% Completed | 18/40 [03:01<03:40, ...]   (default)
#   Loading safetensors using Fastsafetensor loader:  50% Completed | 2/4 [...]   (files per rank)
#   Loading safetensors using InstantTensor loader:  45% Completed | 53.2G/118G [...]   (bytes)
_BAR = re.compile(
    r"Loading (?P<desc>safetensors checkpoint shards(?: \(eager\))?|safetensors using "
    r"(?P<loader>[\w .:-]+?)(?: loader)?|np_cache checkpoint shards):\s*(?P<percent>\d+)% "
    r"Completed \|\s*(?P<done>[\d.]+[kMGTP]?)/(?P<total>[\d.]+[kMGTP]?)"
)
# The bar's words for a loader, as ``--load-format`` names it.
_LOADERS = {
    "Fastsafetensor": "fastsafetensors",
    "InstantTensor": "instanttensor",
    "Runai Model Streamer": "runai_streamer",
}
# vLLM's DefaultModelLoader (and the sharded-state one), whatever the loader.
_WEIGHTS_TOOK = re.compile(r"Loading weights took ([\d.]+) seconds")


@dataclass(frozen=True)
class LoadProgress:
    percent: int
    done: int  # shards (or file groups) read; 0 for a bar that counts bytes
    total: int
    loader: str = ""  # the --load-format whose bar it is; "" for vLLM's default loader
    amount: str = ""  # a bar that counts bytes: "53.2G/118G"

    def words(self) -> str:
        """ "18/40 shards", "53.2G/118G": how far, in the bar's own unit."""
        return self.amount or f"{self.done}/{self.total} shards"


def last_load_progress(text: str) -> LoadProgress | None:
    """The latest weight-loading progress in a log excerpt, of whichever loader, if any."""
    found = list(_BAR.finditer(text))
    if not found:
        return None
    bar = found[-1]
    loader = bar["loader"] or ""
    loader = _LOADERS.get(loader, loader.lower().replace(" ", "_"))
    if "np_cache" in bar["desc"]:
        loader = "npcache"
    done, total = bar["done"], bar["total"]
    if done.isdigit() and total.isdigit():
        return LoadProgress(int(bar["percent"]), int(done), int(total), loader)
    return LoadProgress(int(bar["percent"]), 0, 0, loader, f"{done}/{total}")


def weights_load_s(text: str) -> float | None:
    """vLLM's own time for reading the weights ("Loading weights took 812.37 seconds"), from
    the engine's log; the first such line (a rank's, as the API server logs it)."""
    took = _WEIGHTS_TOOK.search(text)
    return float(took.group(1)) if took else None


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
