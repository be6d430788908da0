"""One shape for every launch backend: a ``LaunchPlan`` is what the flow launches, what
wait-ready watches, what status expects and what ``--dry-run`` prints.

A plan is a list of phases, each one step of the runbook (its name is the step's): the phase's
members (containers, one per node at most) start together, then the phase settles (what
"settled" means is the phase's: the containers started, or Ray sees every node alive at its
fabric IP). Pure data, so the flow launches exactly what ``--dry-run`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from vllm_redeploy.launch.entrypoint import ImageEntrypoint
from vllm_redeploy.launch.group import LABEL_LAUNCH, LABEL_LOADER, NodeFabric, container_argv
from vllm_redeploy.nodes.containers import ContainerSpec

# started: the containers were started (they find each other by themselves);
# ray-members: Ray sees every node alive at its fabric IP, with its GPUs.
Settle = Literal["started", "ray-members"]
# The step that starts vLLM itself (Ray's engine, or every rank of vLLM's own launcher): one
# name whatever the backend, so summaries, metrics and dashboards compare runs across them.
LAUNCH_VLLM = "launch-vllm"


@dataclass(frozen=True)
class Phase:
    """One launch step: its members start together, then it settles."""

    step: str  # the runbook's step name, as timed in the summary
    settle: Settle = "started"


@dataclass(frozen=True)
class Member:
    """One container of the group: where, in which phase, doing what."""

    node: str
    role: str  # ray-head, ray-worker, engine (Ray); leader, follower (mp)
    phase: int  # index into the plan's phases
    spec: ContainerSpec
    what: str  # the member in words: "the vLLM follower"
    serves_api: bool = False


@dataclass(frozen=True)
class LaunchPlan:
    """The group a run launches, and how to read it while it loads and serves."""

    backend: str
    reason: str  # why this backend, for people
    phases: tuple[Phase, ...]
    members: tuple[Member, ...]
    # The head's ports that must be free before the launch (the API's, the backend's), in words.
    ports: tuple[tuple[int, str], ...]
    # Every member but the API's connects to this port on the head (the mp rendezvous). Such
    # a group cannot take a new leader: a member left without its leader is an orphan.
    rendezvous_port: int | None = None
    # Ray forwards every worker's output to the driver: the API member's log holds every
    # rank's NCCL lines. Otherwise each member logs its own ranks.
    ranks_log_to_api: bool = False
    fingerprint: str = ""
    fabric: Mapping[str, NodeFabric] = field(default_factory=dict)
    entrypoint: ImageEntrypoint | None = None  # the image's, as preflight found it
    loader: str = ""  # the weight loader and why, for people ("instanttensor (auto: ...)")
    load_format: str = ""  # the loader's name, for metrics ("default": vLLM's own)

    @property
    def api(self) -> Member:
        """The member that serves the OpenAI-compatible API (its log has the load progress)."""
        return next(m for m in self.members if m.serves_api)

    def phase(self, index: int) -> list[Member]:
        return [m for m in self.members if m.phase == index]

    def on(self, node: str) -> list[Member]:
        return [m for m in self.members if m.node == node]

    @property
    def rank_logs(self) -> list[Member]:
        """The members whose logs hold every rank's NCCL lines."""
        return [self.api] if self.ranks_log_to_api else list(self.members)

    def for_image(self, entrypoint: ImageEntrypoint | None) -> LaunchPlan:
        """The plan for an image with this ENTRYPOINT: kept in every container when it runs its
        arguments (our program becomes its command), else replaced by our program."""
        if entrypoint is None or not entrypoint.kept:
            return replace(self, entrypoint=entrypoint)
        members = tuple(
            replace(m, spec=replace(m.spec, entrypoint=None, command=container_argv(m.spec)))
            for m in self.members
        )
        return replace(self, members=members, entrypoint=entrypoint)

    def stamped(self, fingerprint: str) -> LaunchPlan:
        """The plan with every container labelled with the configuration's launch fingerprint
        (what `ensure` and `status` compare with the configuration later) and the loader."""
        labels = {LABEL_LAUNCH: fingerprint, LABEL_LOADER: self.loader}
        members = tuple(
            replace(m, spec=replace(m.spec, labels={**m.spec.labels, **labels}))
            for m in self.members
        )
        return replace(self, members=members, fingerprint=fingerprint)
