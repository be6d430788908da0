"""Steps 3 and 4 (Ray backend): the Ray head, then the workers; one container per node, each
node pinned to its own fabric IP. The head is waited for (its `ray start` says when it is up);
the workers are not: the cluster check waits until Ray has them all."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run, StepFailed, log
from tasks.launch import member, start_member
from vllm_redeploy.plan import LaunchPlan
from vllm_redeploy.ray_log import wait_ray_started
from vllm_redeploy.safe_text import block

# Past this without `ray start`'s success line (a Ray build may word it differently), the head
# is taken as starting and the cluster check, which asks Ray itself, decides.
HEAD_LINE_WAIT_S = 15.0


# Not cached: it starts a container that a later run must start again.
@task(name="ray-head", task_run_name="ray-head[{name}]", cache_policy=NO_CACHE, **RETRY_START)
def start_ray_head(run: Run, name: str, plan: LaunchPlan) -> str:
    """Start the head and wait until it is up; returns the container ID."""
    head = member(plan, name, "ray-head")
    container_id = start_member(run, head)
    wait_s = min(HEAD_LINE_WAIT_S, run.config.deadlines.ray_cluster_s)
    start = wait_ray_started(run.node(name).docker, head.spec.name, wait_s)
    if start.exited:
        raise StepFailed(
            "ray-head",
            f"the Ray head container on {name} exited with code {start.exit_code}. "
            f"Last log lines:\n{block(start.tail)}",
        )
    if not start.started:
        log().warning(
            "the Ray head on %s has not reported its start yet. Last log lines:\n%s",
            name,
            block(start.tail),
        )
    return container_id


# Not cached: it starts a container that a later run must start again.
@task(name="join-worker", task_run_name="join-worker[{name}]", cache_policy=NO_CACHE, **RETRY_START)
def join_worker(run: Run, name: str, plan: LaunchPlan) -> str:
    """Start a worker; it joins the head by itself. Returns the container ID."""
    return start_member(run, member(plan, name, "ray-worker"))
