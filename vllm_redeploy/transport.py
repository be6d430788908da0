"""Which transport NCCL used between the nodes, per node, read from the ranks' own logs. No
Prefect here: the flow proves it after every launch, `status` shows it, `fabric --log` judges a
saved log the same way.

With Ray, every rank's lines reach the engine's log (the workers' with Ray's ``(RayWorkerWrapper
pid=..., ip=...)`` prefix: the ``ip`` names the node; lines without one are the head's own); with
the mp backend each node's ranks log in its own container. A node whose every rank said ``Using
network IB`` used RDMA; ``Socket`` means TCP through the kernel (the model answers, at a fraction
of the decode speed). No such line is ``unknown``, never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_redeploy.parsers.nccl_log import RankTransport, Transport, judge_transport


@dataclass(frozen=True)
class NodeTransport:
    node: str
    transport: Transport
    hcas: tuple[str, ...] = ()  # the HCAs its ranks used
    warnings: tuple[str, ...] = ()

    def phrase(self) -> str:
        hcas = f" over {', '.join(self.hcas)}" if self.hcas else ""
        return f"{self.node}: {self.transport}{hcas}"


@dataclass(frozen=True)
class TransportVerdict:
    transport: Transport  # the whole group's: rdma only when every rank used RDMA
    nodes: tuple[NodeTransport, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {
            "transport": self.transport,
            "nodes": {n.node: {"transport": n.transport, "hcas": list(n.hcas)} for n in self.nodes},
        }


def judge_nodes(
    logs: Sequence[tuple[str, str]], node_ips: Mapping[str, str], nodes: Sequence[str]
) -> TransportVerdict:
    """``logs``: (node whose container wrote it, its text); ``node_ips``: fabric IP -> node."""
    ranks: dict[str, list[RankTransport]] = {n: [] for n in nodes}
    for writer, text in logs:
        for rank in judge_transport(text).ranks:
            node = node_ips.get(rank.ip, writer) if rank.ip else writer
            ranks.setdefault(node, []).append(rank)
    verdicts = tuple(_node(node, found) for node, found in ranks.items())
    kinds = {v.transport for v in verdicts}
    if kinds == {"rdma"}:
        overall: Transport = "rdma"
    elif kinds <= {"socket"} and kinds:
        overall = "socket"
    elif {"rdma", "socket"} <= kinds and kinds <= {"rdma", "socket"}:
        overall = "mixed"
    else:
        overall = "unknown"
    return TransportVerdict(overall, verdicts)


def _node(node: str, ranks: list[RankTransport]) -> NodeTransport:
    chose = {r.network for r in ranks if r.network}
    if chose == {"IB"}:
        transport: Transport = "rdma"
    elif chose == {"Socket"}:
        transport = "socket"
    elif chose == {"IB", "Socket"}:
        transport = "mixed"
    else:
        transport = "unknown"
    hcas = tuple(dict.fromkeys(h for r in ranks for h in r.hcas))
    warnings = tuple(dict.fromkeys(w for r in ranks for w in r.warnings))
    return NodeTransport(node, transport, hcas, warnings)
