"""The group's logs without knowing its containers' names: the plan of what runs (by its
containers' backend label) says which container is which member, on which node, in which role.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.launch.choose import BACKENDS, assumed, plan_for
from vllm_redeploy.launch.group import LABEL_BACKEND
from vllm_redeploy.launch.plan import LaunchPlan
from vllm_redeploy.nodes import NodeAccess, fan_out
from vllm_redeploy.nodes.containers import cluster_labels


@dataclass(frozen=True)
class LogSource:
    """One member's container, as a person asks for it: on a node, in a role."""

    node: str
    role: str  # the plan's: leader, follower (mp); ray-head, ray-worker, engine (Ray)
    container: str

    @property
    def label(self) -> str:
        return f"{self.node} {self.role}"


@dataclass(frozen=True)
class GroupLogs:
    """What runs of the group: its plan, the members whose container is there, and the nodes
    that could not be asked (name, why)."""

    plan: LaunchPlan
    sources: list[LogSource]
    unreachable: list[tuple[str, str]]

    @property
    def roles(self) -> list[str]:
        return list(dict.fromkeys(m.role for m in self.plan.members))


def group_logs(config: ClusterConfig) -> GroupLogs:
    """Ask every node, in parallel, which of the group's containers it holds."""
    listed = fan_out(config.nodes, lambda node: _ours(node, config))
    found = {o.node: o.value for o in listed if o.value is not None}
    backends = (b for names in found.values() for b in names.values() if b in BACKENDS)
    plan = plan_for(next(backends, assumed(config)), config)
    sources = [
        LogSource(m.node, m.role, m.spec.name)
        for m in sorted(plan.members, key=lambda m: m.phase)
        if m.spec.name in found.get(m.node, {})
    ]
    unreachable = [(o.node, str(o.error)) for o in listed if o.error is not None]
    return GroupLogs(plan, sources, unreachable)


def _ours(node: NodeConfig, config: ClusterConfig) -> dict[str, str]:
    """The group's containers on ``node`` (running or not): name → backend."""
    with NodeAccess(node, config) as access:
        found = access.docker.list_containers(labels=cluster_labels(config.name))
    return {c.name: c.labels[LABEL_BACKEND] for c in found if LABEL_BACKEND in c.labels}


def read(
    config: ClusterConfig,
    source: LogSource,
    *,
    follow: bool = False,
    since: float | None = None,
    tail: int | str = "all",
) -> Iterator[str]:
    """``source``'s log lines, read over the node's own connection (closed at the end)."""
    node = next(n for n in config.nodes if n.name == source.node)
    with NodeAccess(node, config) as access:
        yield from access.docker.log_lines(source.container, follow=follow, since=since, tail=tail)


def chosen(
    logs: GroupLogs, nodes: Sequence[str] = (), roles: Sequence[str] = ()
) -> list[LogSource]:
    return [
        s for s in logs.sources if (not nodes or s.node in nodes) and (not roles or s.role in roles)
    ]
