"""How the Ray backend's launch settles: Ray sees every node alive at its fabric IP with every GPU
(the "ray-members" phase, step "cluster-check"). The head and the workers start one right after
the other (the workers wait for the head's GCS by themselves), so this is where both starts are
waited for. While the nodes start, each one's Ray log, followed as it is written, says when it
has registered; Ray's own member list then decides. A head or worker whose Ray exits meanwhile
fails at once, with its log. No Prefect here: a failure is a ``SettleFailed``, which the launch
step reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch.backend import GroupMember, SettleFailed
from vllm_redeploy.launch.ray import (
    membership_problems,
    parse_members,
    ray_container,
    ray_members_argv,
)
from vllm_redeploy.launch.ray_log import RayStart, RayStartFollowers
from vllm_redeploy.nodes import CommandError, CommandFailed
from vllm_redeploy.nodes.docker import NodeDocker
from vllm_redeploy.safe_text import block, one_line

DockerOf = Callable[[str], NodeDocker]  # a node's Docker, by the node's name
# Ask Ray itself at least this often, even before every node logged its start (a Ray build may
# word its success line differently); each look runs Python in the head container.
LOOK_EVERY_S = 3.0
# Every node started but Ray's list not whole yet (a GPU not registered): asked again this soon.
LOOK_AGAIN_S = 0.5
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
    starts = RayStarts(config, docker_of, log)
    next_look = started + LOOK_EVERY_S
    problems: list[str] = []
    while True:
        starts.settle(min(next_look, started + window) - time.monotonic())
        now = time.monotonic()
        if not starts.pending or now >= next_look:
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
            next_look = time.monotonic() + (LOOK_AGAIN_S if not starts.pending else LOOK_EVERY_S)
        if now - started >= window:
            status = head.exec_runner(ray_container(config)).run(
                ["ray", "status"], timeout=60, check=False
            )
            raise SettleFailed(
                f"after {window:g} s: {'; '.join(problems)}. "
                f"ray status:\n{block(status.stdout.strip() or status.stderr.strip())}"
            )


class RayStarts:
    """Every node's `ray start`, followed in its container's log from the moment the wait
    begins; a worker whose raylet registered too late for Ray is started once more."""

    def __init__(
        self,
        config: ClusterConfig,
        docker_of: DockerOf,
        log: logging.Logger | logging.LoggerAdapter,
        names: list[str] | None = None,
    ) -> None:
        self._config = config
        self._docker_of = docker_of
        self._log = log
        self._followers = RayStartFollowers(docker_of, ray_container(config))
        self.pending = set(names if names is not None else (n.name for n in config.nodes))
        self.again: set[str] = set()  # the workers started a second time
        for name in self.pending:
            self._followers.follow(name)

    def settle(self, timeout_s: float) -> None:
        """Take the starts that end within ``timeout_s`` (every one that already has, at
        least); fails if a node's Ray exited. With none pending, only waits."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        if not self.pending:
            time.sleep(max(timeout_s, 0.0))
            return
        while self.pending and (ended := self._followers.next(deadline - time.monotonic())):
            self._take(*ended)

    def _take(self, name: str, start: RayStart | BaseException) -> None:
        if isinstance(start, BaseException):
            raise start
        if start.started:
            self.pending.discard(name)
            return
        worker = name != self._config.head.name
        if worker and name not in self.again and RAYLET_LATE in start.tail:
            self._log.warning(
                "Ray on %s registered too late for Ray's 30 s: starting it again", name
            )
            self.again.add(name)
            self._docker_of(name).start(ray_container(self._config))
            self._followers.follow(name)
            return
        ip = next(n.ip for n in self._config.nodes if n.name == name)
        role = "worker" if worker else "head"
        raise SettleFailed(
            f"Ray on {name} ({role}, {ip}) exited with code {start.exit_code} while "
            f"starting. Last log lines:\n{block(start.tail)}"
        )
