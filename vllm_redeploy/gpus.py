"""Is a node's GPU free? Judged from nvidia-smi and, on unified memory (GB10), /proc/meminfo."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_redeploy.memory import Meminfo, parse_meminfo
from vllm_redeploy.nodes import Runner
from vllm_redeploy.nodes.result import CommandResult
from vllm_redeploy.parsers.nvidia_smi import (
    ANSWERED,
    COMPUTE_APPS_ARGV,
    GPUS_ARGV,
    ComputeApp,
    GpuInfo,
    parse_compute_apps,
    parse_gpus,
    warnings,
)
from vllm_redeploy.safe_text import shown

# An idle discrete GPU reports ~0 MiB used; more than this with no process listed means the
# memory has not come back yet (a process still exiting, or one nvidia-smi cannot see).
MEMORY_SLACK_MIB = 1024
_MEMINFO = re.compile(r"^(MemTotal|MemAvailable):\s+(\d+) kB$", re.MULTILINE)


@dataclass(frozen=True)
class GpuReport:
    node: str
    gpus: list[GpuInfo]
    processes: list[ComputeApp]
    mem_available_mib: int | None = None
    mem_total_mib: int | None = None
    problems: list[str] = field(default_factory=list)
    meminfo: Meminfo | None = None  # /proc/meminfo as read with the GPUs (the memory step's too)
    warnings: list[str] = field(default_factory=list)  # nvidia-smi's, with a full answer

    @property
    def clear(self) -> bool:
        return not self.problems

    @property
    def unified_memory(self) -> bool:
        return any(not g.memory_reported for g in self.gpus)

    def summary(self) -> str:
        if self.clear:
            kind = "unified memory" if self.unified_memory else "memory back"
            extra = ""
            if self.mem_available_mib is not None and self.unified_memory:
                extra = f", MemAvailable {self.mem_available_mib / 1024:.1f} GiB"
            warned = "".join(f"; nvidia-smi: {shown(w)}" for w in self.warnings)
            return f"{self.node}: GPU clear ({kind}{extra}){warned}"
        return f"{self.node}: " + "; ".join(self.problems)


def inspect_gpus(node: str, runner: Runner, timeout: float = 30.0) -> GpuReport:
    """Query the node's GPUs and compute processes; graphics processes do not count."""
    apps, listed, memory = runner.run_all(
        [COMPUTE_APPS_ARGV, GPUS_ARGV, ["cat", "/proc/meminfo"]], timeout=timeout
    )
    return judge_gpus(
        node,
        answered(runner, apps, timeout).stdout,
        answered(runner, listed, timeout).stdout,
        runner.checked(memory, timeout).stdout,
    )


def answered(runner: Runner, result: CommandResult, timeout: float | None = None) -> CommandResult:
    """nvidia-smi's ``result`` when it came with a full answer (exit 0, or 14 with its
    infoROM warning); else its command again alone, raising CommandFailed in its words."""
    return result if result.exit_code in ANSWERED else runner.checked(result, timeout)


def judge_gpus(node: str, apps_csv: str, gpus_csv: str, meminfo_text: str) -> GpuReport:
    """The report from what nvidia-smi and /proc/meminfo printed."""
    processes = parse_compute_apps(apps_csv)
    gpus = parse_gpus(gpus_csv)
    meminfo = dict(_MEMINFO.findall(meminfo_text))
    problems = [
        f"PID {p.pid} ({shown(p.process_name)}) holds "
        + (f"{p.used_mib} MiB" if p.used_mib is not None else "GPU memory")
        for p in processes
    ]
    if not processes:
        for gpu in gpus:
            if gpu.memory_used_mib is not None and gpu.memory_used_mib > MEMORY_SLACK_MIB:
                problems.append(
                    f"GPU {gpu.index} still has {gpu.memory_used_mib} MiB in use "
                    "with no process listed"
                )
    if not gpus:
        problems.append("nvidia-smi lists no GPU")

    def mib(key: str) -> int | None:
        return int(meminfo[key]) // 1024 if key in meminfo else None

    return GpuReport(
        node,
        gpus,
        processes,
        mib("MemAvailable"),
        mib("MemTotal"),
        problems,
        parse_meminfo(meminfo_text),
        list(dict.fromkeys(warnings(apps_csv) + warnings(gpus_csv))),
    )
