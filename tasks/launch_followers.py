"""Step "launch-followers" (mp backend): `vllm serve ... --node-rank r --headless` on every
node but the head, each pinned to its fabric IP. They connect to the leader's rendezvous port and
keep retrying until it is up, so they go first (see vllm_redeploy/plan_mp.py)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run
from tasks.launch import member, start_member
from vllm_redeploy.plan import LaunchPlan
from vllm_redeploy.plan_mp import FOLLOWER_ROLE


# Not cached: it starts a container that a later run must start again.
@task(
    name="launch-follower",
    task_run_name="launch-follower[{name}]",
    cache_policy=NO_CACHE,
    **RETRY_START,
)
def launch_follower(run: Run, name: str, plan: LaunchPlan) -> str:
    """Start the node's follower; returns the container ID."""
    return start_member(run, member(plan, name, FOLLOWER_ROLE))
