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


def tail_for_people(text: str, lines: int) -> str:
    """The last ``lines`` lines of a log, NCCL's INFO lines left out."""
    kept = [line for line in text.splitlines() if not _NCCL_INFO.search(line)]
    return "\n".join(kept[-lines:])
