"""For `ensure`: is the running deployment whole and healthy, with the configured settings?"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.cluster_check import ray_members
from tasks.context import Run, log
from tasks.probe import probe
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.nodes import RemoteError, fan_out
from vllm_redeploy.plan import (
    LABEL_LAUNCH,
    engine_container,
    launch_fingerprint,
    membership_problems,
    ray_container,
)


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str


# Not cached: health is only true now.
@task(name="inspect-deployment", cache_policy=NO_CACHE)
def inspect_deployment(run: Run) -> Health:
    """Healthy only if every Ray container runs, Ray has every node, the engine runs with this
    configuration, the served name is listed and the probe passes."""
    config = run.config
    outcomes = fan_out(config.nodes, lambda n: run.node(n.name).docker.get(ray_container(config)))
    for outcome in outcomes:
        if outcome.error is not None:
            return _unhealthy(f"{outcome.node} cannot be inspected: {outcome.error}")
        if outcome.value is None or not outcome.value.running:
            return _unhealthy(f"the Ray container on {outcome.node} is not running")
    engine = run.head.docker.get(engine_container(config))
    if engine is None or not engine.running:
        return _unhealthy("the vLLM engine is not running")
    if engine.labels.get(LABEL_LAUNCH) != launch_fingerprint(config):
        return _unhealthy("the engine runs with other settings than the configuration's")
    try:
        problems = membership_problems(config, ray_members(run))
    except RemoteError as exc:
        return _unhealthy(f"Ray membership unknown: {exc}")
    if problems:
        return _unhealthy("; ".join(problems))
    verdict = probe(run)
    if not verdict.healthy:
        return _unhealthy(f"the probe at {api_base(config)} failed: {verdict.detail}")
    log().info("deployment healthy: %s", verdict.detail)
    return Health(True, verdict.detail)


def _unhealthy(reason: str) -> Health:
    log().info("deployment needs a redeploy: %s", reason)
    return Health(False, reason)
