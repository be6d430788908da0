"""The launch steps: one per phase of the launch plan (vllm_redeploy/launch). A phase's members
start together, one task each, then the phase settles the way the plan says (tasks/ray_settle.py
for the Ray backend's head and membership)."""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from tasks.context import RETRY_START, Run, log
from tasks.ray_settle import check_ray_cluster
from vllm_redeploy.launch import LaunchPlan, Member, container_argv
from vllm_redeploy.launch.plan import Settle
from vllm_redeploy.launch.ray import RayMember
from vllm_redeploy.nodes.result import render_command

# How each kind of phase settles; what it returns is Ray's membership when it asked Ray.
SETTLES: dict[Settle, Callable[[Run, list[Member]], list[RayMember]]] = {
    "started": lambda run, members: [],
    "ray-members": lambda run, members: check_ray_cluster(run),
}


def launch_phase(run: Run, plan: LaunchPlan, index: int) -> list[RayMember]:
    """Start the phase's members in parallel (the first failure raises), then settle it."""
    phase = plan.phases[index]
    members = plan.phase(index)
    futures = [start_member.submit(run, m, phase.step) for m in members]
    wait(futures)
    for future in futures:
        future.result()
    return SETTLES[phase.settle](run, members)


# Not cached: it starts a container, which a later run must start again.
@task(
    name="launch",
    task_run_name="{step}[{member.node}]",
    cache_policy=NO_CACHE,
    **RETRY_START,
)
def start_member(run: Run, member: Member, step: str) -> str:
    """Replace whatever container of that name is left and start this one; its ID."""
    docker = run.node(member.node).docker
    spec = member.spec
    run.before_change()  # a retry too: a run that lost the cluster removes nothing of the next
    docker.remove(spec.name)
    container_id = docker.run_detached(spec)
    log().info(
        "started %s on %s (%s): %s",
        spec.name,
        member.node,
        member.role,
        render_command(container_argv(spec), run.config.secret_values()),
    )
    return container_id
