"""For `ensure`: is the running deployment whole and healthy, with the configured settings?

The judgement is `vllm-redeploy status`'s own (``vllm_redeploy.status``), so the two never
disagree about a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, log
from vllm_redeploy.status import collect_status


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str


# Not cached: health is only true now.
@task(name="inspect-deployment", task_run_name="inspect-deployment", cache_policy=NO_CACHE)
def inspect_deployment(run: Run) -> Health:
    """Healthy only if every node is reachable, every container of the group runs (the engine
    with this configuration), Ray has every node, the served name is listed and the probe
    passes."""
    status = collect_status(run.config)
    if status.problems:
        reason = "; ".join(status.problems)
        log().info("deployment needs a redeploy: %s", reason)
        return Health(False, reason)
    probe = status.endpoint.probe
    detail = probe.detail if probe is not None else "healthy"
    log().info("deployment healthy: %s", detail)
    return Health(True, detail)
