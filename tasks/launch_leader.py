"""Step "launch-leader" (mp backend): `vllm serve ... --node-rank 0` on the head. It hosts
the rendezvous, loads once every follower has joined, and serves the API."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run
from tasks.launch import start_member
from vllm_redeploy.plan import LaunchPlan


# Not cached: it starts the leader, which a later run must start again.
@task(name="launch-leader", cache_policy=NO_CACHE, **RETRY_START)
def launch_leader(run: Run, plan: LaunchPlan) -> str:
    """Start the leader container; returns its ID."""
    return start_member(run, plan.api)
