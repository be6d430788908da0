"""Step "memory": on unified memory (GB10), drop the page cache and make sure vLLM will find the
memory it asks for, before anything starts.

The cache is dropped through a one-shot container of the vLLM image (Docker access is root on
the node already: no sudo), right before the launch: the previous model's load left the cache
full, and vLLM counts cached pages as used. Then ``MemFree`` must cover ``gpu_memory_utilization``
of the node's memory; if it does not, the run fails here naming the largest memory holders,
instead of vLLM refusing to start minutes later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.gpus import GpuReport
from vllm_redeploy.memory import (
    DROP_CACHES,
    DROP_SCRIPT,
    GIB,
    MEMINFO_ARGV,
    TOP_MEMORY_ARGV,
    Meminfo,
    needed_kib,
    parse_meminfo,
    parse_top_memory,
)
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec, project_labels
from vllm_redeploy.safe_text import shown

STEP = "memory"
DROP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MemoryReport:
    node: str
    unified: bool
    dropped: bool
    before: Meminfo | None
    after: Meminfo | None
    needed_kib: int | None = None  # what vLLM will ask for (unified memory only)

    def summary(self) -> str:
        if self.after is None:
            return f"{self.node}: memory not read"
        after = f"{self.after.free_gib:.1f} GiB"
        text = f"MemFree {after}"
        if self.dropped and self.before is not None:
            text = f"page cache dropped, MemFree {self.before.free_gib:.1f} → {after}"
        if self.needed_kib is not None:
            text += f" (vLLM asks {self.needed_kib / GIB:.1f} GiB)"
        return f"{self.node}: {text}"


def drop_cache_spec(run: Run) -> ContainerSpec:
    """A one-shot container that drops the node's page cache: root in it writes the host's
    drop_caches, bind-mounted (a container's own /proc/sys is read-only; the sysctl checks only
    that the writer is root, and no capability is needed, so it is not privileged)."""
    config = run.config
    return ContainerSpec(
        name=container_name(config.name, "drop-cache"),
        image=config.vllm.image,
        entrypoint=["sh"],
        command=["-c", DROP_SCRIPT],
        # The configured mounts too, as the preflight check's: an image may need them to run.
        volumes=[*config.vllm.volumes, f"{DROP_CACHES}:/drop_caches"],
        labels=project_labels(config.name, "drop-cache"),
    )


# Not cached: it changes the node (its page cache) and the answer is only true now.
@task(name="memory", task_run_name="memory[{name}]", cache_policy=NO_CACHE, **RETRY_TRANSIENT)
def make_memory_free(run: Run, name: str, gpus: Mapping[str, GpuReport]) -> MemoryReport:
    config = run.config
    access = run.node(name)
    unified = gpus[name].unified_memory if name in gpus else False
    drop = config.memory.drop_page_cache
    drop = unified if drop is None else drop
    # Read with the GPUs a moment ago, in the same round trip: no need to ask again.
    before = gpus[name].meminfo if name in gpus else None
    before = before or _meminfo(run, name)
    if drop:
        code, output = access.docker.run_to_completion(drop_cache_spec(run), DROP_TIMEOUT_S)
        if code != 0:
            raise StepFailed(
                STEP,
                f"could not drop the page cache on {name}: the one-shot container exited with "
                f"code {code}: {shown(output.strip()[-300:])}. Set [memory] drop_page_cache = "
                "false to skip it (then vLLM may refuse to start on unified memory)",
            )
    after = _meminfo(run, name) if drop else before
    need = needed_kib(after, config.vllm.gpu_memory_utilization) if unified and after else None
    report = MemoryReport(name, unified, drop, before, after, need)
    log().info(report.summary())
    if need is not None and after is not None and after.free_kib < need:
        raise StepFailed(STEP, _too_little(run, name, after, need, drop))
    return report


def _meminfo(run: Run, name: str) -> Meminfo | None:
    text = run.node(name).runner.run(list(MEMINFO_ARGV), timeout=30).stdout
    return parse_meminfo(text)


def _too_little(run: Run, name: str, after: Meminfo, need: int, dropped: bool) -> str:
    top = parse_top_memory(run.node(name).runner.run(list(TOP_MEMORY_ARGV), check=False).stdout)
    holders = ", ".join(f"{shown(h.name)} (PID {h.pid}, {h.rss_kib / GIB:.1f} GiB)" for h in top)
    util = run.config.vllm.gpu_memory_utilization or 0.9
    when = " after dropping the page cache" if dropped else ""
    return (
        f"{name} has {after.free_gib:.1f} GiB free{when}, but vLLM will ask for "
        f"{need / GIB:.1f} GiB (gpu_memory_utilization {util:g} of "
        f"{after.total_kib / GIB:.1f} GiB) and refuse to start. The largest memory holders: "
        f"{holders or 'unknown'}. Stop what is not needed there, or lower "
        "vllm.gpu_memory_utilization"
    )
