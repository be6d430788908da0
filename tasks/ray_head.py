"""Step 3, Ray head: on the head node, in a container, pinned to the head's fabric IP."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run, StepFailed, log
from vllm_redeploy.plan import ray_container, ray_spec

STEP = "ray-head"
POLL_S = 0.5


# Not cached: it starts a container that a later run must start again.
@task(
    name="ray-head",
    task_run_name="ray-head[{name}]",
    cache_policy=NO_CACHE,
    **RETRY_START,
)
def start_ray_head(run: Run, name: str) -> str:
    """Start the head and wait until its GCS answers; returns the container ID."""
    config = run.config
    docker = run.node(name).docker
    spec = ray_spec(config.head, config)
    docker.remove(spec.name)
    container_id = docker.run_detached(spec)
    address = f"{config.head.ip}:{config.ray.port}"
    check = ["ray", "health-check", f"--address={address}"]
    deadline = time.monotonic() + config.deadlines.ray_cluster_s
    runner = docker.exec_runner(spec.name)
    while True:
        info = docker.get(spec.name)
        if info is None or not info.running:
            tail = docker.logs_tail(spec.name, 20) if info else ""
            raise StepFailed(STEP, f"the Ray head container on {name} exited: {tail.strip()}")
        if runner.run(check, timeout=30, check=False).ok:
            log().info("Ray head up on %s at %s", name, address)
            return container_id
        if time.monotonic() >= deadline:
            tail = docker.logs_tail(ray_container(config), 20)
            raise StepFailed(
                STEP,
                f"Ray head on {name} did not answer at {address} within "
                f"{config.deadlines.ray_cluster_s:g} s: {tail.strip()}",
            )
        time.sleep(POLL_S)
