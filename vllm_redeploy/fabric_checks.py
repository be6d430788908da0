"""Preflight's fabric checks beyond :meth:`FabricFacts.problems`, which sees one node's facts
only: the MTUs across the nodes, and the configured ``fabric_interfaces``/``ib_hcas`` against what
the node has.

RoCE does not negotiate the MTU as TCP does its segment size: nodes whose RoCE netdevs differ
pass every TCP check and then hang in NCCL (NVIDIA/nccl#2135); a node that lost a hand-set MTU
9000 at a reboot is the usual cause. InfiniBand's MTU comes from the subnet manager and TCP
adapts, so only the netdevs RoCE traffic goes through are compared. Configured names override
discovery (:mod:`vllm_redeploy.launch.group`), so nothing else would notice one that is wrong.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_redeploy.parsers.fabric import FabricFacts, Hca

# operstate of an interface that passes traffic; UNKNOWN: lo and some virtual drivers.
_PASSING = frozenset({"UP", "UNKNOWN"})
# An NCCL_IB_HCA entry: ``name`` (what the configuration accepts) or NCCL's ``name:port``.
_HCA_ENTRY = re.compile(r"(?P<name>.+?)(?::(?P<port>\d+))?")


@dataclass(frozen=True)
class Port:
    """A netdev that one node's RoCE traffic goes through, and its MTU."""

    node: str
    interface: str
    mtu: int


def roce_ports(
    node: str,
    facts: FabricFacts,
    fabric_interfaces: Sequence[str] = (),
    ib_hcas: Sequence[str] = (),
) -> tuple[Port, ...]:
    """The node's RoCE netdevs with their MTU: the interface owning the fabric IP, the configured
    ``fabric_interfaces`` and the netdevs of the HCAs NCCL will use (``ib_hcas``, else the
    discovered ones). Empty when the node's NCCL will not use RoCE: no ACTIVE RoCE HCA, or no
    verbs device for its containers (as :class:`~vllm_redeploy.launch.NodeFabric` decides)."""
    hcas = _configured_hcas(facts, ib_hcas) if ib_hcas else facts.nccl_hcas
    roce = [h for h in hcas if h.roce and h.active]
    if not roce or not facts.rdma_devices:
        return ()
    names = [facts.interface, *fabric_interfaces, *(n for h in roce for n in h.netdevs)]
    by_name = {i.name: i for i in facts.interfaces}
    found = (by_name.get(n) for n in dict.fromkeys(n for n in names if n))
    return tuple(
        Port(node, i.name, i.mtu)
        for i in found
        if i is not None and i.mtu is not None and i.operstate in _PASSING
    )


def mtu_mismatches(ports: Sequence[Port]) -> list[str]:
    """One problem per port whose MTU is not the cluster's; none unless ports of two nodes are
    given. The cluster's MTU is the most common one, the larger on a tie: a lost MTU 9000 is the
    usual fault, so the node to fix is the one that fell back to 1500."""
    if len({p.node for p in ports}) < 2:
        return []
    counts = Counter(p.mtu for p in ports)
    wanted = max(counts, key=lambda mtu: (counts[mtu], mtu))
    like = [p for p in ports if p.mtu == wanted]
    problems = []
    for odd in (p for p in ports if p.mtu != wanted):
        other = next((p for p in like if p.node != odd.node), like[0])
        problems.append(
            f"{odd.node}'s {odd.interface} has MTU {odd.mtu}, {other.node}'s {other.interface} "
            f"has {other.mtu}: RoCE does not negotiate the MTU, so NCCL between the nodes would "
            f"hang (NVIDIA/nccl#2135); set the same MTU on every node's fabric interfaces (e.g. "
            f"`sudo ip link set {odd.interface} mtu {wanted}` on {odd.node}, and in netplan so "
            "it survives a reboot)"
        )
    return problems


def configured_name_problems(
    facts: FabricFacts, fabric_interfaces: Sequence[str], ib_hcas: Sequence[str]
) -> list[str]:
    """What is wrong with the node's configured ``fabric_interfaces`` and ``ib_hcas``, each
    with what the node has instead; empty when they fit, or when the probe listed no interface
    (``FabricFacts.problems`` says so) or could not list the HCAs (then no HCA is judged)."""
    if not facts.interfaces:
        return []
    return [
        *_interface_problems(facts, fabric_interfaces),
        *(_hca_problems(facts, fabric_interfaces, ib_hcas) if facts.rdma_checked else []),
    ]


def _interface_problems(facts: FabricFacts, configured: Sequence[str]) -> list[str]:
    by_name = {i.name: i for i in facts.interfaces}
    carrying = {facts.interface, *facts.twins, *facts.also_on} - {None}
    suggested = list(facts.socket_ifnames[: max(1, len(configured))])
    if facts.interface is None:
        where = f"the fabric IP {facts.fabric_ip} is on no interface of this node"
        fix = "assign it (or fix fabric_ip), or leave fabric_interfaces out to use discovery"
    else:
        where = f"the fabric IP {facts.fabric_ip} is on {_with_twins(facts)}"
        fix = f"set fabric_interfaces = {_toml(suggested)} or leave it out to use discovery"
    problems = []
    for name in configured:
        interface = by_name.get(name)
        if interface is None:
            what = "which this node does not have"
        elif interface.operstate not in _PASSING:
            state = interface.operstate or "not up"
            if name == facts.interface:  # the right one, down: naming another will not help
                problems.append(
                    f"fabric_interfaces names {name}, which carries the fabric IP but is {state}: "
                    f"bring it up (`sudo ip link set {name} up`) and check its cable"
                )
                continue
            what = f"which is {state} on this node"
        elif facts.interface is not None and name not in carrying:
            what = "which neither carries the fabric IP nor is a twin of the interface that does"
        else:
            continue
        problems.append(f"fabric_interfaces names {name}, {what}; {where}: {fix}")
    return problems


def _hca_problems(
    facts: FabricFacts, fabric_interfaces: Sequence[str], configured: Sequence[str]
) -> list[str]:
    served = {facts.interface, *facts.twins, *facts.members, *fabric_interfaces} - {None}
    fabric = facts.fabric_hcas
    if not facts.hcas:
        where = "this node has no RDMA HCA (`rdma link` lists none)"
    elif fabric:
        listed = ", ".join(f"{h.name} ({h.state})" for h in fabric)
        where = f"the HCAs of {_with_twins(facts)} are {listed}"
    else:
        where = f"no HCA serves {facts.interface or 'the fabric IP'}"
    active = list(dict.fromkeys(h.name for h in facts.nccl_hcas))
    fix = (
        f"set ib_hcas = {_toml(active)} or leave it out to use discovery"
        if active
        else "leave ib_hcas out"
    )
    problems = []
    for entry in configured:
        ports = _configured_hcas(facts, [entry])
        tied = [h for h in ports if h.active and h.netdevs]  # IB without IPoIB has no netdev
        if not ports:
            what = "which this node does not have"
        elif not any(h.active for h in ports):
            what = f"which is {'/'.join(sorted({h.state for h in ports}))} on this node"
        elif tied and not any(served.intersection(h.netdevs) for h in tied):
            netdevs = ", ".join(dict.fromkeys(n for h in tied for n in h.netdevs))
            what = f"which serves {netdevs}, none of the fabric's interfaces"
        else:
            continue
        problems.append(f"ib_hcas names {entry}, {what}; {where}: {fix}")
    return problems


def _configured_hcas(facts: FabricFacts, entries: Sequence[str]) -> list[Hca]:
    """The HCA ports the entries name: ``name`` is every port of that device, ``name:port``
    the one port (NCCL_IB_HCA's forms)."""
    found: list[Hca] = []
    for entry in entries:
        match = _HCA_ENTRY.fullmatch(entry)
        if match is None:
            continue
        port = int(match["port"]) if match["port"] else None
        found += [
            h
            for h in facts.hcas
            if h.name == match["name"] and (port is None or h.port == port) and h not in found
        ]
    return found


def _with_twins(facts: FabricFacts) -> str:
    if not facts.twins:
        return str(facts.interface)
    word = "twin" if len(facts.twins) == 1 else "twins"
    return f"{facts.interface} ({word} {', '.join(facts.twins)})"


def _toml(names: Sequence[str]) -> str:
    return json.dumps(list(names))  # a JSON list of strings is a TOML array
