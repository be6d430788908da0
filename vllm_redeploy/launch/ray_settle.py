"""How the Ray backend's launch settles: Ray sees every node alive at its fabric IP with every GPU
(the "ray-members" phase, step "cluster-check"). The head and the workers start one right after
the other (the workers wait for the head's GCS by themselves), so this is where both starts are
waited for. While the nodes start, each one's Ray log says when it has registered (a cheap read);
Ray's own member list then decides. A head or worker whose Ray exits meanwhile fails at once,
with its log. No Prefect here: a failure is a ``SettleFailed``, which the launch step reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch.backend import GroupMember, SettleFailed
from vllm_redeploy.launch.ray import (
    membership_problems,
    parse_members,
    ray_container,
    ray_members_argv,
)
from vllm_redeploy.launch.ray_log import wait_ray_started
from vllm_redeploy.nodes import CommandError, CommandFailed
from vllm_redeploy.nodes.docker import NodeDocker
from vllm_redeploy.safe_text import block, one_line

DockerOf = Callable[[str], NodeDocker]  # a node's Docker, by the node's name
POLL_S = 0.1
# Ask Ray itself at least this often, even before every node logged its start (a Ray build may
# word its success line differently); each look runs Python in the head container.
LOOK_EVERY_S = 3.0
# Ray gives a new node's raylet a fixed 30 s to register with the GCS (ray/_private/node.py, not
# configurable), then `ray start` exits with this: many workers joining a busy head at once can
# miss it. The head is up by then; the worker is started once more.
RAYLET_LATE = "The current node timed out during startup"


class MembersUnread(Exception):
    """The member list was not read this time: the reading process was killed by a signal (the
    kernel's OOM killer on a head busy with the nodes' starts), which says nothing about Ray."""


def ray_members(config: ClusterConfig, head: NodeDocker) -> list[GroupMember]:
    """Ray's own member list; a script that fails or prints no member list is "could not
    check" (a SettleFailed), never an empty cluster; one killed by a signal is MembersUnread."""
    runner = head.exec_runner(ray_container(config))
    try:
        result = runner.run(ray_members_argv(config), timeout=60)
        return parse_members(result.stdout)
    except CommandFailed as exc:
        code = exc.result.exit_code or 0
        if code > 128:  # 128 + the signal's number, as a shell and Docker report it
            raise MembersUnread(
                f"the read of Ray's members on {config.head.name} was killed by signal "
                f"{code - 128} (exit code {code})"
            ) from None
        raise SettleFailed(f"could not check Ray's members on {config.head.name}: {exc}") from None
    except (CommandError, ValueError, KeyError, TypeError) as exc:
        raise SettleFailed(
            f"could not check Ray's members on {config.head.name}: "
            + (str(exc) if isinstance(exc, CommandError) else one_line(exc))
        ) from None


def wait_members(
    config: ClusterConfig, docker_of: DockerOf, log: logging.Logger | logging.LoggerAdapter
) -> list[GroupMember]:
    """Until Ray sees every node with its GPUs, up to [deadlines] ray_cluster_s."""
    window = config.deadlines.ray_cluster_s
    head = docker_of(config.head.name)
    started = time.monotonic()
    starting = [n.name for n in config.nodes]
    again: set[str] = set()  # the workers started a second time
    next_look = started + LOOK_EVERY_S
    problems: list[str] = []
    while True:
        starting = still_starting(config, docker_of, starting, again, log)
        now = time.monotonic()
        if not starting or now >= next_look:
            try:
                members = ray_members(config, head)
                problems = membership_problems(config, members)
            except MembersUnread as exc:
                log.warning("%s; asking again", exc)
                members, problems = [], [str(exc)]
            if not problems:
                gpus = sum(m.gpus for m in members if m.alive)
                log.info("Ray sees %d nodes and %g GPUs", len(members), gpus)
                return members
            next_look = time.monotonic() + (POLL_S * 5 if not starting else LOOK_EVERY_S)
        if now - started >= window:
            status = head.exec_runner(ray_container(config)).run(
                ["ray", "status"], timeout=60, check=False
            )
            raise SettleFailed(
                f"after {window:g} s: {'; '.join(problems)}. "
                f"ray status:\n{block(status.stdout.strip() or status.stderr.strip())}"
            )
        time.sleep(POLL_S)


def still_starting(
    config: ClusterConfig,
    docker_of: DockerOf,
    names: list[str],
    again: set[str],
    log: logging.Logger | logging.LoggerAdapter,
) -> list[str]:
    """The nodes whose `ray start` has not reported success yet; fails if one exited (a worker
    whose raylet registered too late for Ray is first started once more). Every node is read at
    once: one look costs the same round trips with 8 nodes as with 2."""
    pending = []
    ips = {n.name: n.ip for n in config.nodes}
    container = ray_container(config)
    with ThreadPoolExecutor(max_workers=max(len(names), 1), thread_name_prefix="ray-start") as pool:
        starts = list(pool.map(lambda n: wait_ray_started(docker_of(n), container, 0), names))
    for name, start in zip(names, starts, strict=True):
        docker = docker_of(name)
        worker = name != config.head.name
        if start.exited and worker and name not in again and RAYLET_LATE in start.tail:
            log.warning("Ray on %s registered too late for Ray's 30 s: starting it again", name)
            again.add(name)
            docker.start(ray_container(config))
            pending.append(name)
            continue
        if start.exited:
            role = "worker" if worker else "head"
            raise SettleFailed(
                f"Ray on {name} ({role}, {ips[name]}) exited with code {start.exit_code} while "
                f"starting. Last log lines:\n{block(start.tail)}"
            )
        if not start.started:
            pending.append(name)
    return pending
