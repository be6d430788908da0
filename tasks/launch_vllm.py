"""Step 6, launch vLLM: `vllm serve` across the cluster, in its own container on the head."""

from __future__ import annotations

from dataclasses import replace

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_START, Run, log
from vllm_redeploy.nodes.result import render_command
from vllm_redeploy.plan import LABEL_LAUNCH, engine_spec, launch_fingerprint


# Not cached: it starts the engine, which a later run must start again.
@task(
    name="launch-vllm",
    cache_policy=NO_CACHE,
    **RETRY_START,
)
def launch_vllm(run: Run) -> str:
    """Start the engine container; returns its ID. Its log stays with the container."""
    config = run.config
    spec = engine_spec(config)
    spec = replace(spec, labels={**spec.labels, LABEL_LAUNCH: launch_fingerprint(config)})
    docker = run.head.docker
    docker.remove(spec.name)
    container_id = docker.run_detached(spec)
    log().info(
        "launched %s on %s: %s",
        spec.name,
        config.head.name,
        render_command(list(spec.command), config.secret_values()),
    )
    return container_id
