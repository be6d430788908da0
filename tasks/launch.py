"""Starting one member of the launch plan on its node: what every launch step does."""

from __future__ import annotations

from tasks.context import Run, log
from vllm_redeploy.nodes.result import render_command
from vllm_redeploy.plan import LaunchPlan, Member, container_argv


def member(plan: LaunchPlan, node: str, role: str) -> Member:
    """The plan's ``role`` container on ``node``."""
    return next(m for m in plan.on(node) if m.role == role)


def start_member(run: Run, member: Member) -> str:
    """Replace whatever container of that name is left and start this one; its ID."""
    docker = run.node(member.node).docker
    spec = member.spec
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
