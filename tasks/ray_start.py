"""Steps 3 and 4, Ray: the head, then the workers; one container per node, each node pinned to
its own fabric IP. The head is waited for (its `ray start` says when it is up); the workers are
not: the cluster check waits until Ray has them all."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run, StepFailed, log
from vllm_redeploy.plan import ray_spec
from vllm_redeploy.ray_log import wait_ray_started
from vllm_redeploy.safe_text import block

# Past this without `ray start`'s success line (a Ray build may word it differently), the head
# is taken as starting and the cluster check, which asks Ray itself, decides.
HEAD_LINE_WAIT_S = 15.0


# Not cached: it starts a container that a later run must start again.
@task(name="ray-head", task_run_name="ray-head[{name}]", cache_policy=NO_CACHE, **RETRY_START)
def start_ray_head(run: Run, name: str) -> str:
    """Start the head and wait until it is up; returns the container ID."""
    config = run.config
    container_id = _start(run, name)
    wait_s = min(HEAD_LINE_WAIT_S, config.deadlines.ray_cluster_s)
    start = wait_ray_started(run.node(name).docker, ray_spec(config.head, config).name, wait_s)
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
def join_worker(run: Run, name: str) -> str:
    """Start a worker; it joins the head by itself. Returns the container ID."""
    return _start(run, name)


def _start(run: Run, name: str) -> str:
    config = run.config
    node = run.node_config(name)
    docker = run.node(name).docker
    spec = ray_spec(node, config)
    docker.remove(spec.name)
    container_id = docker.run_detached(spec)
    role = "head" if node is config.head else f"worker of {config.head.ip}:{config.ray.port}"
    log().info("Ray starting on %s as %s at %s", name, role, node.ip)
    return container_id
