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
