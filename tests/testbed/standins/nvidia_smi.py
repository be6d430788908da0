"""The ``nvidia-smi`` stand-in: prints real nvidia-smi formats from a node's emulated GPU state.

Run as ``python3 path/to/nvidia_smi.py ARGS`` (how the test bed's ``nvidia-smi`` wrapper execs it,
with ``VRD_GPU_STATE`` set) or as ``python -m tests.testbed.standins.nvidia_smi ARGS``.
Standard library only. Formats follow real captures: ``tests/fixtures/nvidia_smi/h200`` (H200,
driver 580.159.04) and ``tests/fixtures/nvidia_smi/gb10`` (DGX Spark samples from public reports).

Supported: no arguments (the table), ``-L``, ``--version``, ``-i/--id``, ``--query-gpu=...`` and
``--query-compute-apps=...`` with ``--format=csv[,noheader][,nounits]``. Errors go to stdout with
nvidia-smi's exit codes: 2 bad argument or field, 6 no such device, 9 no driver (no state).
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

try:
    from . import gpu_state
except ImportError:  # run as a plain script: gpu_state.py sits next to this file
    import gpu_state

KIB_PER_MIB = 1024
NO_DEVICES = "No devices were found\n"
INVALID_ARGS = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
_UUID_NAMESPACE = uuid.UUID("6f1d3c52-54a4-4d0e-9a43-3c1e3e0a7c11")


@dataclass(frozen=True)
class Profile:
    name: str
    total_mib: int | None  # None: unified memory, which nvidia-smi does not report
    # H200 memory model, fitted to the three captures (idle, busy, busy2): the driver holds
    # 614.75 MiB out of "free", and each process costs 6 MiB (plus 2.625 MiB once) that counts
    # in memory.used but not in its own used_memory. Values are rounded to the nearest MiB.
    reserved_kib: int
    base_kib: int
    per_process_kib: int
    bus_id: str  # format with bus_base + the GPU index
    bus_base: int
    display_active: str
    ecc: str
    mig: str
    power_cap_w: int | None
    temperature_c: int
    idle: tuple[str, float]  # (performance state, power draw in W)
    busy: tuple[str, float]
    compute_cap: str
    driver_version: str
    cuda_version: str


PROFILES: dict[str, Profile] = {
    "h200": Profile(
        name="NVIDIA H200",
        total_mib=143771,
        reserved_kib=629_504,
        base_kib=2_688,
        per_process_kib=6_144,
        bus_id="00000000:00:{:02X}.0",
        bus_base=6,
        display_active="Off",
        ecc="0",
        mig="Disabled",
        power_cap_w=700,
        temperature_c=38,
        idle=("P0", 118.0),
        busy=("P0", 118.0),
        compute_cap="9.0",
        driver_version="580.159.04",
        cuda_version="13.0",
    ),
    "gb10": Profile(
        name="NVIDIA GB10",
        total_mib=None,
        reserved_kib=0,
        base_kib=0,
        per_process_kib=0,
        bus_id="0000000F:{:02X}:00.0",
        bus_base=1,
        display_active="Off",
        ecc="N/A",
        mig="N/A",
        power_cap_w=None,
        temperature_c=40,
        idle=("P8", 4.0),
        busy=("P0", 11.0),
        compute_cap="12.1",
        driver_version="580.142",
        cuda_version="13.0",
    ),
}


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    bus_id: str
    profile: Profile
    processes: tuple[gpu_state.GpuProcess, ...]

    def _used_kib(self) -> int:
        held = sum(p.used_mib for p in self.processes) * KIB_PER_MIB
        if not self.processes:
            return held
        return held + self.profile.base_kib + self.profile.per_process_kib * len(self.processes)

    @property
    def memory_used_mib(self) -> int | None:
        return None if self.profile.total_mib is None else _round_mib(self._used_kib())

    @property
    def memory_free_mib(self) -> int | None:
        if self.profile.total_mib is None:
            return None
        free = self.profile.total_mib * KIB_PER_MIB - self.profile.reserved_kib - self._used_kib()
        return max(0, _round_mib(free))

    @property
    def state(self) -> tuple[str, float]:
        computing = any("C" in p.type for p in self.processes)
        return self.profile.busy if computing else self.profile.idle


@dataclass(frozen=True)
class Node:
    driver_version: str
    cuda_version: str
    gpus: tuple[Gpu, ...]


class UsageError(Exception):
    """A failure nvidia-smi reports on stdout with an exit code."""

    def __init__(self, text: str, code: int) -> None:
        super().__init__(text)
        self.text = text
        self.code = code


def _round_mib(kib: int) -> int:
    return (kib + KIB_PER_MIB // 2) // KIB_PER_MIB


def load_node(directory: Path) -> Node:
    config = gpu_state.read_config(directory)
    profile = PROFILES[config.get("profile", "h200")]
    count = int(config.get("gpus", 1))
    uuids = list(config.get("uuids", []))
    for index in range(len(uuids), count):
        name = f"{directory.resolve()}:{index}"
        uuids.append(f"GPU-{uuid.uuid5(_UUID_NAMESPACE, name)}")
    procs = sorted(gpu_state.live_processes(directory), key=lambda p: (p.gpu, p.pid))
    gpus = tuple(
        Gpu(
            index=index,
            uuid=uuids[index],
            bus_id=profile.bus_id.format(profile.bus_base + index),
            profile=profile,
            processes=tuple(p for p in procs if p.gpu == index),
        )
        for index in range(count)
    )
    driver = str(config.get("driver_version", profile.driver_version))
    cuda = str(config.get("cuda_version", profile.cuda_version))
    return Node(driver, cuda, gpus)


# --- CSV queries -------------------------------------------------------------------------------

Getter = Callable[[Gpu, Node], object]
# field -> (header, unit, value); a value of None prints as [N/A].
GPU_FIELDS: dict[str, tuple[str, str | None, Getter]] = {
    "index": ("index", None, lambda g, n: g.index),
    "uuid": ("uuid", None, lambda g, n: g.uuid),
    "name": ("name", None, lambda g, n: g.profile.name),
    "count": ("count", None, lambda g, n: len(n.gpus)),
    "driver_version": ("driver_version", None, lambda g, n: n.driver_version),
    "pci.bus_id": ("pci.bus_id", None, lambda g, n: g.bus_id),
    "compute_cap": ("compute_cap", None, lambda g, n: g.profile.compute_cap),
    "memory.total": ("memory.total [MiB]", "MiB", lambda g, n: g.profile.total_mib),
    "memory.used": ("memory.used [MiB]", "MiB", lambda g, n: g.memory_used_mib),
    "memory.free": ("memory.free [MiB]", "MiB", lambda g, n: g.memory_free_mib),
    "utilization.gpu": ("utilization.gpu [%]", "%", lambda g, n: 0),
    "temperature.gpu": ("temperature.gpu", None, lambda g, n: g.profile.temperature_c),
    "power.draw": ("power.draw [W]", "W", lambda g, n: f"{g.state[1]:.2f}"),
}

AppGetter = Callable[[gpu_state.GpuProcess, Gpu], object]
APP_FIELDS: dict[str, tuple[str, str | None, AppGetter]] = {
    "pid": ("pid", None, lambda p, g: p.pid),
    "process_name": ("process_name", None, lambda p, g: p.name),
    "name": ("process_name", None, lambda p, g: p.name),
    "used_memory": ("used_gpu_memory [MiB]", "MiB", lambda p, g: p.used_mib),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB", lambda p, g: p.used_mib),
    "gpu_uuid": ("gpu_uuid", None, lambda p, g: g.uuid),
    "gpu_bus_id": ("gpu_bus_id", None, lambda p, g: g.bus_id),
    "gpu_name": ("gpu_name", None, lambda p, g: g.profile.name),
}


def _parse_format(spec: str | None) -> tuple[bool, bool]:
    """``csv[,noheader][,nounits]`` -> (header, units)."""
    parts = [part.strip() for part in (spec or "").split(",")]
    if not parts or parts[0] != "csv" or not set(parts[1:]) <= {"noheader", "nounits"}:
        raise UsageError(INVALID_ARGS, 2)
    return "noheader" not in parts, "nounits" not in parts


def _check_fields(names: list[str], known: Collection[str]) -> None:
    for name in names:
        if name not in known:
            raise UsageError(f'Field "{name}" is not a valid field to query.\n\n', 2)


def _cell(value: object, unit: str | None, units: bool) -> str:
    if value is None:
        return "[N/A]"
    return f"{value} {unit}" if unit and units else str(value)


def _csv(header_cells: list[str], rows: list[list[str]], header: bool) -> str:
    lines = ([", ".join(header_cells)] if header else []) + [", ".join(r) for r in rows]
    return "".join(line + "\n" for line in lines)


def query_gpus(gpus: tuple[Gpu, ...], node: Node, fields: str, fmt: str | None) -> str:
    names = [f.strip() for f in fields.split(",")]
    _check_fields(names, GPU_FIELDS)
    header, units = _parse_format(fmt)
    specs = [GPU_FIELDS[name] for name in names]
    rows = [[_cell(get(g, node), unit, units) for _, unit, get in specs] for g in gpus]
    return _csv([title for title, _, _ in specs], rows, header)


def query_compute_apps(gpus: tuple[Gpu, ...], fields: str, fmt: str | None) -> str:
    names = [f.strip() for f in fields.split(",")]
    _check_fields(names, APP_FIELDS)
    header, units = _parse_format(fmt)
    specs = [APP_FIELDS[name] for name in names]
    rows = [
        [_cell(get(p, g), unit, units) for _, unit, get in specs]
        for g in gpus
        for p in g.processes
        if "C" in p.type  # graphics-only (G) processes are not compute apps
    ]
    return _csv([title for title, _, _ in specs], rows, header)


# --- The table, -L, --version -------------------------------------------------------------------

_RULE = "+" + "-" * 89 + "+"
_GPU_RULE = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
_GPU_HEADER = (
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
    "|                                         |                        |               MIG M. |",
    "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
)
_PROC_HEADER = (
    "| Processes:" + " " * 78 + "|",
    "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
    "|        ID   ID                                                               Usage      |",
    "|" + "=" * 89 + "|",
)


def _clip_tail(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _clip_head(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _gpu_rows(gpu: Gpu) -> list[str]:
    p = gpu.profile
    pstate, watts = gpu.state
    cap = f"{p.power_cap_w}W".rjust(5) + " " if p.power_cap_w else " N/A  "
    left = f" N/A{f'{p.temperature_c}C':>6}{pstate:>6}{f'{round(watts)}W':>16} / {cap}"
    if p.total_mib is None:
        memory = " Not Supported".ljust(24)
    else:
        memory = f"{gpu.memory_used_mib}MiB".rjust(11) + " / " + f"{p.total_mib}MiB".rjust(9) + " "
    return [
        f"|{gpu.index:>4}  {_clip_head(p.name, 31):<31}On  "
        f"|   {gpu.bus_id} {p.display_active:>3} |{p.ecc:>21} |",
        f"|{left}|{memory}|{'0%':>8}{'Default':>13} |",
        f"|{'':41}|{'':24}|{p.mig:>21} |",
        _GPU_RULE,
    ]


def _process_row(gpu: Gpu, proc: gpu_state.GpuProcess) -> str:
    memory = _clip_head(f"{proc.used_mib}MiB", 8)
    name = _clip_tail(proc.name, 32)
    return f"|{gpu.index:>5}   N/A  N/A{proc.pid:>16}{proc.type:>7}   {name:<32}      {memory:>8} |"


def table(gpus: tuple[Gpu, ...], node: Node) -> str:
    versions = (
        f"| NVIDIA-SMI {node.driver_version:<23}Driver Version: {node.driver_version:<15}"
        f"CUDA Version: {node.cuda_version:<9}|"
    )
    lines = [time.asctime() + " " * 7, _RULE, versions, _GPU_RULE, *_GPU_HEADER]
    for gpu in gpus:
        lines += _gpu_rows(gpu)
    lines += ["", _RULE, *_PROC_HEADER]
    procs = [_process_row(g, p) for g in gpus for p in g.processes]
    lines += procs or ["|  No running processes found".ljust(90) + "|"]
    lines.append(_RULE)
    return "".join(line + "\n" for line in lines)


def list_gpus(gpus: tuple[Gpu, ...]) -> str:
    return "".join(f"GPU {g.index}: {g.profile.name} (UUID: {g.uuid})\n" for g in gpus)


def version(node: Node) -> str:
    nvml = ".".join(node.driver_version.split(".")[:2])
    return (
        f"NVIDIA-SMI version  : {node.driver_version}\n"
        f"NVML version        : {nvml}\n"
        f"DRIVER version      : {node.driver_version}\n"
        f"CUDA Version        : {node.cuda_version}\n"
    )


# --- Command line -------------------------------------------------------------------------------

_VALUED = {
    "-i": "id",
    "--id": "id",
    "--format": "format",
    "--query-gpu": "query-gpu",
    "--query-compute-apps": "query-compute-apps",
}
_FLAGS = {
    "-L": "list",
    "--list-gpus": "list",
    "--version": "version",
    "-h": "help",
    "--help": "help",
}


def parse_args(argv: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    args = iter(argv)
    for arg in args:
        key, eq, value = arg.partition("=")
        if key in _VALUED:
            if not eq:
                value = next(args, "")
            options[_VALUED[key]] = value
        elif arg in _FLAGS:
            options[_FLAGS[arg]] = ""
        elif arg.startswith("-i") and arg[2:].isdigit():
            options["id"] = arg[2:]
        else:
            raise UsageError(INVALID_ARGS, 2)
    if "query-gpu" in options and "query-compute-apps" in options:
        raise UsageError(INVALID_ARGS, 2)
    return options


def select(node: Node, ids: str | None) -> tuple[Gpu, ...]:
    if ids is None:
        return node.gpus
    chosen = []
    for wanted in (part.strip() for part in ids.split(",")):
        match = [g for g in node.gpus if wanted in (str(g.index), g.uuid, g.bus_id)]
        if not match:
            raise UsageError(NO_DEVICES, 6)
        chosen += [g for g in match if g not in chosen]
    return tuple(chosen)


def run(argv: list[str]) -> str:
    options = parse_args(argv)
    if "help" in options:
        return "NVIDIA System Management Interface (test-bed stand-in).\n"
    try:
        directory = gpu_state.state_dir()
        node = load_node(directory)
        time.sleep(float(gpu_state.read_config(directory).get("answer_s", 0)))
    except (RuntimeError, OSError, ValueError) as exc:
        raise UsageError(NO_DRIVER, 9) from exc
    if "version" in options:
        return version(node)
    gpus = select(node, options.get("id"))
    if "list" in options:
        return list_gpus(gpus)
    if "query-gpu" in options:
        return query_gpus(gpus, node, options["query-gpu"], options.get("format"))
    if "query-compute-apps" in options:
        return query_compute_apps(gpus, options["query-compute-apps"], options.get("format"))
    if "format" in options:
        raise UsageError(INVALID_ARGS, 2)
    return table(gpus, node)


# nvidia-smi's return code when a GPU's infoROM is corrupted: it still answers in full, then
# warns, once per such GPU (microsoft/pai#3756, NVIDIA/gpu-operator#20, pytorch/pytorch#87464).
INFOROM_CORRUPTED = 14


def main(argv: list[str] | None = None) -> int:
    try:
        sys.stdout.write(run(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        sys.stdout.write(exc.text)
        return exc.code
    return _faults()


def _faults() -> int:
    """What the node's config adds to a full answer: ``inforom_corrupted`` (GPU indexes: their
    warnings, exit 14) and ``garbage`` (a line nvidia-smi never prints as a row, appended)."""
    directory = gpu_state.state_dir()
    config = gpu_state.read_config(directory)
    if config.get("garbage"):
        sys.stdout.write(f"{config['garbage']}\n")
    corrupted = [int(i) for i in config.get("inforom_corrupted", [])]
    if not corrupted:
        return 0
    profile = PROFILES[config.get("profile", "h200")]
    for index in corrupted:
        bus_id = profile.bus_id.format(profile.bus_base + index)
        sys.stdout.write(f"WARNING: infoROM is corrupted at gpu {bus_id.removeprefix('0000')}\n")
    return INFOROM_CORRUPTED


if __name__ == "__main__":
    sys.exit(main())
