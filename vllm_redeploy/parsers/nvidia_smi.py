"""Parse nvidia-smi's CSV queries (``--format=csv[,noheader][,nounits]``) for the GPUs-clear step.

The shapes follow real captures (``tests/fixtures/nvidia_smi``): cells are separated by ``", "``;
an optional header names the fields with their unit (``memory.total [MiB]``, and
``used_gpu_memory [MiB]`` for the ``used_memory`` field); values carry the unit (``20998 MiB``)
unless ``nounits``; what a GPU does not report is a bracketed marker. A DGX Spark (GB10, unified
memory) prints ``[N/A]`` for memory.total/used/free, while its compute apps keep real numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

COMPUTE_APP_FIELDS: tuple[str, ...] = ("pid", "process_name", "used_memory")
GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
)
_FORMAT = "--format=csv,noheader,nounits"
COMPUTE_APPS_ARGV: tuple[str, ...] = (
    "nvidia-smi",
    f"--query-compute-apps={','.join(COMPUTE_APP_FIELDS)}",
    _FORMAT,
)
GPUS_ARGV: tuple[str, ...] = ("nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", _FORMAT)

# nvidia-smi's exit codes that come with its full answer: 14, a GPU's infoROM is corrupted
# (the GPU works and vLLM runs on it; nvidia-smi warns on stdout, "WARNING: infoROM is
# corrupted at gpu ..."). Any other non-zero code is a failure.
ANSWERED = frozenset({0, 14})
WARNING = "WARNING:"

# Markers nvidia-smi prints instead of a value it cannot read.
UNAVAILABLE = frozenset(
    {"[N/A]", "N/A", "[Not Supported]", "[Insufficient Permissions]", "[Unknown Error]"}
)
# The header nvidia-smi prints for a field, where it differs from the field's name.
_HEADER_NAMES = {"used_memory": "used_gpu_memory"}
_UNITS = (" MiB", " %", " W")


@dataclass(frozen=True)
class ComputeApp:
    """One process that holds a CUDA context (types C and C+G; graphics-only G is not listed)."""

    pid: int
    process_name: str
    used_mib: int | None  # None when nvidia-smi cannot read it


@dataclass(frozen=True)
class GpuInfo:
    """One GPU; fields that were not queried or not reported (``[N/A]``) are None."""

    index: int
    name: str
    uuid: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None

    @property
    def memory_reported(self) -> bool:
        """False on unified-memory GPUs (GB10): judge them by compute apps and MemAvailable."""
        return self.memory_total_mib is not None


def parse_compute_apps(text: str, fields: Sequence[str] = COMPUTE_APP_FIELDS) -> list[ComputeApp]:
    """Parse ``--query-compute-apps`` output; ``fields`` is the query's field list, in order.

    No process gives empty output (with ``noheader``) or the header alone: both are ``[]``.
    """
    apps = []
    for line, row in _rows(text, fields, free_text="process_name", required=("pid",)):
        apps.append(
            ComputeApp(
                pid=_int(row["pid"], line),
                process_name=row.get("process_name", ""),
                used_mib=_mib(row["used_memory"], line) if "used_memory" in row else None,
            )
        )
    return apps


def parse_gpus(text: str, fields: Sequence[str] = GPU_FIELDS) -> list[GpuInfo]:
    """Parse ``--query-gpu`` output; ``fields`` is the query's field list, in order."""
    gpus = []
    for line, row in _rows(text, fields, free_text="name", required=("index", "name")):
        memory = {
            key: _mib(row[field], line) if field in row else None
            for key, field in (
                ("memory_total_mib", "memory.total"),
                ("memory_used_mib", "memory.used"),
                ("memory_free_mib", "memory.free"),
            )
        }
        index = _int(row["index"], line)
        gpus.append(GpuInfo(index=index, name=row["name"], uuid=row.get("uuid"), **memory))
    return gpus


def warnings(text: str) -> list[str]:
    """The ``WARNING:`` lines nvidia-smi printed with its answer (never rows)."""
    return [line.strip() for line in text.splitlines() if line.strip().startswith(WARNING)]


def _rows(
    text: str, fields: Sequence[str], free_text: str, required: Sequence[str]
) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield (line, {field: cell}) for each data line, after checking an optional header."""
    missing = [field for field in required if field not in fields]
    if missing:
        raise ValueError(f"nvidia-smi query must include {', '.join(missing)}")
    lines = [
        line.strip()
        for line in text.split("\n")
        if line.strip() and not line.strip().startswith(WARNING)
    ]
    headers = [_HEADER_NAMES.get(field, field) for field in fields]
    if lines and lines[0].split(", ")[0] == headers[0]:
        found = [cell.split(" [")[0] for cell in lines[0].split(", ")]
        if found != headers:
            raise ValueError(f"nvidia-smi header does not match the query {headers}: {lines[0]!r}")
        lines = lines[1:]
    for line in lines:
        cells = [cell.strip() for cell in line.split(", ")]
        extra = len(cells) - len(fields)
        if extra > 0 and free_text in fields:  # a name that itself contains ", "
            at = list(fields).index(free_text)
            cells[at : at + extra + 1] = [", ".join(cells[at : at + extra + 1])]
        if len(cells) != len(fields):
            raise ValueError(
                f"nvidia-smi line has {len(cells)} fields, expected {len(fields)} "
                f"({', '.join(fields)}): {line!r}"
            )
        yield line, dict(zip(fields, cells, strict=True))


def _strip_unit(value: str) -> str:
    for unit in _UNITS:
        if value.endswith(unit):
            return value[: -len(unit)]
    return value


def _int(value: str, line: str) -> int:
    try:
        return int(_strip_unit(value))
    except ValueError:
        raise ValueError(f"nvidia-smi value {value!r} is not a number: {line!r}") from None


def _mib(value: str, line: str) -> int | None:
    return None if value in UNAVAILABLE else _int(value, line)
