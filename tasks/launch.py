"""The launch steps: one per phase of the launch plan (vllm_redeploy/launch). A phase's members
start together, one task each, then the phase settles the way the plan says: "started" is done
once they are; any other way is the plan's backend's to wait for (Ray's: it sees every node)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from tasks.context import RETRY_START, RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.launch import LaunchPlan, Member, container_argv
from vllm_redeploy.launch.backend import GroupStatus, SettleFailed
from vllm_redeploy.launch.choose import BACKENDS
from vllm_redeploy.launch.plan import Settle
from vllm_redeploy.nodes.result import render_command


def launch_phase(run: Run, plan: LaunchPlan, index: int) -> GroupStatus | None:
    """Start the phase's members in parallel (the first failure raises), then settle it; what
    the backend says of the group when it was asked (Ray: its members)."""
    phase = plan.phases[index]
    members = plan.phase(index)
    futures = [start_member.submit(run, m, phase.step) for m in members]
    wait(futures)
    for future in futures:
        future.result()
    if phase.settle == "started":
        return None
    return settle_phase(run, plan.backend, phase.settle, phase.step)


# Not cached: that the group settled is only true now. Retried for a lost connection only.
@task(
    name="settle",
    task_run_name="{step}",
    cache_policy=NO_CACHE,
    **RETRY_TRANSIENT,
)
def settle_phase(run: Run, backend: str, settle: Settle, step: str) -> GroupStatus:
    """Wait as the plan's backend says the phase settles; its failure is the step's."""
    try:
        return BACKENDS[backend].settle(settle, run.config, lambda n: run.node(n).docker, log())
    except SettleFailed as exc:
        raise StepFailed(step, str(exc)) from None


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
