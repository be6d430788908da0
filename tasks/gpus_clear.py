"""Step "gpus-clear": no compute process on any GPU and memory back where the GPU reports it.

A process that was just stopped takes seconds to release its GPU, so the check is repeated
for a grace period before it fails naming the node, PID, process and memory.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.gpus import GpuReport, inspect_gpus
from vllm_redeploy.nodes import CommandError
from vllm_redeploy.safe_text import one_line

STEP = "gpus-clear"
RECHECK_S = 1.0


# Not cached: the answer is only true now.
@task(
    name="gpus-clear",
    task_run_name="gpus-clear[{name}]",
    cache_policy=NO_CACHE,
    **RETRY_TRANSIENT,
)
def wait_gpus_clear(run: Run, name: str) -> GpuReport:
    grace = run.config.deadlines.gpu_release_s
    deadline = time.monotonic() + grace
    while True:
        try:
            report = inspect_gpus(name, run.node(name).runner)
        except (CommandError, ValueError) as exc:  # never "clear" when we could not look
            raise StepFailed(
                STEP,
                f"could not check the GPUs on {name} (is the NVIDIA driver loaded, and "
                f"nvidia-smi on the login user's PATH?): {_said(exc)}",
            ) from None
        if report.clear:
            log().info(report.summary())
            return report
        if time.monotonic() >= deadline:
            raise StepFailed(
                STEP,
                f"GPU on {name} still busy after {grace:g} s: {'; '.join(report.problems)}. "
                "Stop that process (it is not one the configuration names), or add its "
                "container or unit to [autostart]",
            )
        time.sleep(RECHECK_S)


def _said(exc: Exception) -> str:
    """A command's failure as it already reads (one line, then its output indented), or a
    parser's complaint on one line."""
    return str(exc) if isinstance(exc, CommandError) else one_line(exc)
