"""Step 4, workers join: one Ray container per worker, pinned to the worker's own fabric IP."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run, log
from vllm_redeploy.plan import ray_spec


# Not cached: it starts a container that a later run must start again.
@task(
    name="join-worker",
    task_run_name="join-worker[{name}]",
    cache_policy=NO_CACHE,
    **RETRY_START,
)
def join_worker(run: Run, name: str) -> str:
    config = run.config
    node = run.node_config(name)
    docker = run.node(name).docker
    spec = ray_spec(node, config)
    docker.remove(spec.name)
    container_id = docker.run_detached(spec)
    log().info("worker %s joining %s:%s as %s", name, config.head.ip, config.ray.port, node.ip)
    return container_id
