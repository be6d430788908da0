"""Step "stop-group" (`vllm-redeploy stop`): remove the group on purpose, this project's
containers of the cluster on every node and nothing else; what it removed, and the backend
they were launched by (which says which ports must then be free)."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, log
from vllm_redeploy.launch.group import LABEL_BACKEND
from vllm_redeploy.nodes.containers import cluster_labels


@dataclass(frozen=True)
class Removed:
    node: str
    containers: tuple[str, ...]
    backends: tuple[str, ...]  # the launch backends of what was removed (their label)

    def summary(self) -> str:
        return f"{self.node}: removed {', '.join(self.containers) or 'nothing (none ran)'}"


# Not cached: it removes what runs now. Retried on a dropped connection: removing is idempotent.
# A node it cannot reach fails the step: the group may still run there.
@task(
    name="stop-group",
    task_run_name="stop-group[{name}]",
    cache_policy=NO_CACHE,
    **RETRY_TRANSIENT,
)
def stop_group(run: Run, name: str) -> Removed:
    docker = run.node(name).docker
    found = docker.list_containers(labels=cluster_labels(run.config.name))
    run.before_change()
    docker.remove_all([c.name for c in found])
    backends = {c.labels[LABEL_BACKEND] for c in found if LABEL_BACKEND in c.labels}
    removed = Removed(name, tuple(sorted(c.name for c in found)), tuple(sorted(backends)))
    log().info(removed.summary())
    return removed
