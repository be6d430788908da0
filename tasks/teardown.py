"""Tear the group down: this project's Ray and vLLM containers on every node, nothing else."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, log
from vllm_redeploy.nodes import fan_out
from vllm_redeploy.nodes.containers import cluster_labels


# Not cached: it removes what runs now. Not retried: a node it cannot reach is named in the log
# (the next run's stop-autostart removes what is left).
@task(name="teardown", task_run_name="teardown", cache_policy=NO_CACHE)
def teardown_group(run: Run) -> dict[str, list[str]]:
    """Remove our containers everywhere; a node that cannot be reached is reported, not fatal."""
    labels = cluster_labels(run.config.name)
    run.before_change()  # a run that lost the cluster leaves the group to the run that took it

    def remove(node) -> list[str]:  # type: ignore[no-untyped-def]
        docker = run.node(node.name).docker
        found = docker.list_containers(labels=labels)
        docker.remove_all([c.name for c in found])
        return [c.name for c in found]

    removed: dict[str, list[str]] = {}
    for outcome in fan_out(run.config.nodes, remove):
        if outcome.error is not None:
            log().warning("teardown on %s failed: %s", outcome.node, outcome.error)
        removed[outcome.node] = outcome.value or []
    log().info("removed our containers: %s", removed)
    return removed
