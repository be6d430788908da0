"""Step "launch-vllm" (Ray backend): `vllm serve` across the Ray cluster, in its own container
on the head."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run
from tasks.launch import start_member
from vllm_redeploy.plan import LaunchPlan


# Not cached: it starts the engine, which a later run must start again.
@task(name="launch-vllm", cache_policy=NO_CACHE, **RETRY_START)
def launch_vllm(run: Run, plan: LaunchPlan) -> str:
    """Start the engine container; returns its ID. Its log stays with the container."""
    return start_member(run, plan.api)
