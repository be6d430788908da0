"""What a launch backend is: one object that answers for itself.

A backend has a name (``[vllm] backend``, the containers' label), words for people, its plan
for a configuration, and what it needs of the image: the one-shot container that asks (None:
it asks nothing), how it reads the container's answer, and why it cannot run on an image that
answered so. ``auto`` takes the first backend, in the registry's order (launch/choose.py),
that says it runs on the image.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch.group import NodeFabric
from vllm_redeploy.launch.plan import LaunchPlan, Settle
from vllm_redeploy.nodes.containers import ContainerSpec
from vllm_redeploy.nodes.docker import NodeDocker


class SettleFailed(Exception):
    """A launch phase did not settle; the message says why (the launch step's failure)."""


@dataclass(frozen=True)
class GroupMember:
    """A node as the backend's own bookkeeping lists it (Ray's member list)."""

    ip: str
    alive: bool
    gpus: float


@dataclass(frozen=True)
class GroupStatus:
    """What the backend itself says of the running group, asked on the head: its members where
    it keeps a list (Ray does; mp's ranks are the containers), and what is wrong with them."""

    backend: str = ""
    members: list[GroupMember] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Backend:
    """A backend: what every one must say (its name, its plan) and, with defaults for one that
    asks the image nothing and keeps no list of its own (mp), what one may add (Ray)."""

    name: str = ""  # as ``[vllm] backend`` and the containers' label name it
    words: str = ""  # what it is, for people, after its name ("" when its name says it)
    # When ``auto`` takes it, before the image is asked ("the image carries Ray"); "" for one
    # that asks nothing (it runs on any image, so auto takes it last).
    condition: str = ""
    absent: str = ""  # why ``auto`` passed it over ("the image carries no Ray")
    question_timeout_s: float = 60.0  # how long its one-shot container may take to answer

    def plan(
        self, config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None, reason: str
    ) -> LaunchPlan:
        """The group it launches for ``config``: phases, members, ports."""
        raise NotImplementedError

    def question(self, config: ClusterConfig) -> ContainerSpec | None:
        """The one-shot container of the image whose answer it needs; None: it needs none."""
        return None

    def answer(self, exit_code: int, output: str) -> str | None:
        """What the container's answer means, kept with the image's facts: a value that says
        it runs there (Ray: where `ray` is), or None when it does not."""
        return None

    def found(self, answer: str | None) -> str | None:
        """Why it runs on an image that answered ``answer``, in words ("" when there is
        nothing to say), or None when it does not run there."""
        return ""

    def refusal(self, config: ClusterConfig, answer: str | None) -> str | None:
        """Why it cannot run on an image that answered ``answer``, with the fix; None: it can."""
        return None

    def look(
        self, docker: NodeDocker, config: ClusterConfig, running: Collection[str]
    ) -> GroupStatus:
        """The group as the backend sees it, on the head whose running containers of ours are
        ``running`` (status, the watcher): read only, a few seconds at most. By default its
        ranks are its containers: nothing more to ask."""
        return GroupStatus(self.name)

    def settle(
        self,
        settle: Settle,
        config: ClusterConfig,
        docker_of: Callable[[str], NodeDocker],
        log: logging.Logger | logging.LoggerAdapter,
    ) -> GroupStatus:
        """Wait until a phase of its plan that settles by ``settle`` (not "started") has;
        raises SettleFailed saying why it did not."""
        raise ValueError(f"the {self.name} backend has no phase that settles by {settle!r}")

    def diagnostics(self, docker: NodeDocker, config: ClusterConfig) -> str:
        """What it knows of a failed group, read on the head, as a markdown section ("" when
        it has nothing to add to the containers' logs)."""
        return ""
