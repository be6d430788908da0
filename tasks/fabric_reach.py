"""Step "fabric-reach": every node reaches every other over the fabric IPs on a port of the
ephemeral range (vllm_redeploy.fabric_reach), so a firewall that lets only the named ports
through is named before anything stops or starts. It runs after preflight has judged every node,
never beside it: a peer is only dialled at a fabric IP its node was found to own."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, StepFailed, log
from vllm_redeploy.fabric_reach import (
    TIMEOUT_S,
    NodeReach,
    blocked_message,
    judge,
    pick_port,
    reach_argv,
    reach_spec,
)
from vllm_redeploy.launch import LaunchPlan
from vllm_redeploy.nodes.errors import RemoteError
from vllm_redeploy.safe_text import one_line

STEP = "fabric-reach"
NO_PROGRAM = (126, 127)  # the shell's words for a program it cannot find or run
__all__ = ["judge_reach", "pick_port", "reach_from"]


# Not cached: a firewall changes without the configuration changing. No retries: the nodes'
# checks must run at the same time, and one started again alone would find no peers.
@task(name="fabric-reach", task_run_name="fabric-reach[{name}]", cache_policy=NO_CACHE)
def reach_from(run: Run, name: str, port: int) -> NodeReach:
    """Run ``name``'s check: listen on its fabric IP, connect to every other node's."""
    return reach_on(run, name, port)


def reach_on(run: Run, name: str, port: int, python: str = "python3") -> NodeReach:
    """On the node when it has ``python``, else in a container of the image."""
    access = run.node(name)
    try:
        argv = reach_argv(run.config, name, port, python)
        on_node = access.runner.run(argv, timeout=TIMEOUT_S, check=False)
        if on_node.exit_code not in NO_PROGRAM:
            return NodeReach.parse(name, on_node.exit_code, on_node.stdout)
        code, output = access.docker.run_to_completion(
            reach_spec(run.config, name, port), TIMEOUT_S
        )
    except RemoteError as exc:  # a lost node or Docker: said as unchecked, judged by others
        return NodeReach(name, error=f"could not run the check: {one_line(exc)}")
    return NodeReach.parse(name, code, output)


def judge_reach(run: Run, plan: LaunchPlan, reports: list[NodeReach], port: int) -> list[str]:
    """Fail naming every pair of nodes that cannot reach each other; else the notes on pairs
    the check could not judge."""
    verdict = judge(run.config, reports, port)
    if verdict.blocked:
        named = ", ".join(f"the {what} {number}" for number, what in plan.ports)
        raise StepFailed(STEP, blocked_message(run.config, verdict, reports, named))
    for unchecked in verdict.unchecked:
        log().warning("fabric reach not checked: %s", unchecked)
    if not verdict.unchecked:
        log().info("every node reaches every other over the fabric on port %d", port)
    return [f"fabric reach not checked: {u}" for u in verdict.unchecked]
