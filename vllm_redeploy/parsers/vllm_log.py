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
