"""How the Ray backend's launch settles: Ray sees every node alive at its fabric IP with every GPU
("ray-members", step "cluster-check"). The head and the workers start one right after the other
(the workers wait for the head's GCS by themselves), so this step is where both starts are waited
for. While the nodes start, each one's Ray log says when it has registered (a cheap read); Ray's
own member list then decides. A head or worker whose Ray exits meanwhile fails the step at once,
with its log.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.launch.ray import (
    RayMember,
    membership_problems,
    parse_members,
    ray_container,
    ray_members_argv,
)
from vllm_redeploy.launch.ray_log import wait_ray_started
from vllm_redeploy.nodes import CommandError
from vllm_redeploy.safe_text import block, one_line

STEP = "cluster-check"
POLL_S = 0.1
# Ask Ray itself at least this often, even before every node logged its start (a Ray build may
# word its success line differently); each look runs Python in the head container.
LOOK_EVERY_S = 3.0
# Ray gives a new node's raylet a fixed 30 s to register with the GCS (ray/_private/node.py, not
# configurable), then `ray start` exits with this: many workers joining a busy head at once can
# miss it. The head is up by then; the worker is started once more.
RAYLET_LATE = "The current node timed out during startup"


def ray_members(run: Run) -> list[RayMember]:
    """Ray's own member list; a script that fails or prints no member list is "could not
    check" (a StepFailed), never an empty cluster."""
    runner = run.head.docker.exec_runner(ray_container(run.config))
    try:
        result = runner.run(ray_members_argv(run.config), timeout=60)
        return parse_members(result.stdout)
    except (CommandError, ValueError, KeyError, TypeError) as exc:
        raise StepFailed(
            STEP,
            f"could not check Ray's members on {run.config.head.name}: "
            + (str(exc) if isinstance(exc, CommandError) else one_line(exc)),
        ) from None


# Not cached: membership is only true now.
@task(
    name="cluster-check",
    cache_policy=NO_CACHE,
    **RETRY_TRANSIENT,
)
def check_ray_cluster(run: Run) -> list[RayMember]:
    config = run.config
    window = config.deadlines.ray_cluster_s
    started = time.monotonic()
    starting = [n.name for n in config.nodes]
    again: set[str] = set()  # the workers started a second time
    next_look = started + LOOK_EVERY_S
    problems: list[str] = []
    while True:
        starting = _still_starting(run, starting, again)
        now = time.monotonic()
        if not starting or now >= next_look:
            members = ray_members(run)
            problems = membership_problems(config, members)
            if not problems:
                gpus = sum(m.gpus for m in members if m.alive)
                log().info("Ray sees %d nodes and %g GPUs", len(members), gpus)
                return members
            next_look = time.monotonic() + (POLL_S * 5 if not starting else LOOK_EVERY_S)
        if now - started >= window:
            status = run.head.docker.exec_runner(ray_container(config)).run(
                ["ray", "status"], timeout=60, check=False
            )
            raise StepFailed(
                STEP,
                f"after {window:g} s: {'; '.join(problems)}. "
                f"ray status:\n{block(status.stdout.strip() or status.stderr.strip())}",
            )
        time.sleep(POLL_S)


def _still_starting(run: Run, names: list[str], again: set[str]) -> list[str]:
    """The nodes whose `ray start` has not reported success yet; fails if one exited (a worker
    whose raylet registered too late for Ray is first started once more)."""
    config = run.config
    pending = []
    for name in names:
        docker = run.node(name).docker
        start = wait_ray_started(docker, ray_container(config), 0)
        worker = name != config.head.name
        if start.exited and worker and name not in again and RAYLET_LATE in start.tail:
            log().warning("Ray on %s registered too late for Ray's 30 s: starting it again", name)
            again.add(name)
            docker.start(ray_container(config))
            pending.append(name)
            continue
        if start.exited:
            role = "head" if name == config.head.name else "worker"
            raise StepFailed(
                STEP,
                f"Ray on {name} ({role}, {run.node_config(name).ip}) exited with code "
                f"{start.exit_code} while starting. Last log lines:\n{block(start.tail)}",
            )
        if not start.started:
            pending.append(name)
    return pending
