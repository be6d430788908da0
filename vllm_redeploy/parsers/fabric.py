"""Find a node's fabric: the interface that owns the fabric IP, its twins, its HCAs, NCCL's values.

One read-only command (:data:`FABRIC_ARGV`: no root, no ``ibdev2netdev``, no /sys/class/infiniband)
runs three iproute2 commands and two globs, each section opened by a marker line; every command's
output (stdout and stderr) is followed by its exit status::

    @@ ip-addr
    [{"ifindex":1,"ifname":"lo",...,"addr_info":[...]}, ...]    <- `ip -d -j addr show`
    @@ rc 0
    @@ rdma-dev
    [{"ifindex":0,"ifname":"rocep1s0f1","node_type":"ca","fw":"28.45.4028",
      "node_guid":"3c6d:6603:00a1:b231","sys_image_guid":"3c6d:6603:00a1:b230"}, ...]
    @@ rc 0                                                     <- `rdma -j dev show`
    @@ rdma-link
    [{"ifindex":0,"ifname":"rocep1s0f1","port":1,"state":"ACTIVE","physical_state":"LINK_UP",
      "netdev":"enp1s0f1np1","netdev_index":4}, ...]
    @@ rc 0                                                     <- `rdma -j link show`
    @@ sysfs
    ibdev<TAB>ib0<TAB>mlx5_0<TAB>0       <- netdev, an RDMA device of its PCI function, dev_port
    uverbs<TAB>/dev/infiniband/uverbs0   <- a verbs device node
    @@ end

``ip -d -j`` gives each interface's ``mtu``, ``operstate``, ``master`` (a bond's slaves), ``link``
(a VLAN's parent, or a veth's peer), ``linkinfo.info_kind`` (``vlan``, ``bond``, ``veth``, ...),
``parentbus``/``parentdev`` (``pci``, ``0000:01:00.1``) and ``addr_info[]``. ``rdma`` (iproute2)
prints one JSON array: per device its name and ``sys_image_guid`` (the adapter); per port its
``state`` (ACTIVE, DOWN, INIT, ARMED...), ``physical_state`` (LINK_UP, DISABLED, POLLING...) and,
for RoCE, the ``netdev`` behind it. InfiniBand ports carry ``lid``/``subnet_prefix`` and no
netdev: their IPoIB netdevs come from the ``ibdev`` lines. iproute2 before 6.7 prints the array on
one line, later versions one object per line. Without RDMA support in the kernel ``rdma`` exits 1
with ``Failed to open NETLINK_RDMA socket``; with it but no device it prints ``[]``.

So :attr:`FabricFacts.rdma` tells three cases apart: ``present`` (HCAs listed), ``none`` (``rdma``
answered with no HCA, or failed while /dev/infiniband holds no verbs device: no RDMA here) and
``unknown`` (``rdma`` is missing or failed, yet verbs devices exist: could not check, a problem).

DGX Spark "twins": one QSFP port is two PCIe x4 links (~100G each), so it shows up as two netdevs
and two HCAs whose names differ only by the PCI-domain prefix: ``enp1s0f1np1``/``enP2p1s0f1np1``
and ``rocep1s0f1``/``roceP2p1s0f1`` (systemd names ``en[P<domain>]p<bus>s<slot>f<fn>np<port>``, the
domain only when non-zero). NCCL needs both HCAs in NCCL_IB_HCA for ~200G. The fabric IP usually
sits on one twin (sometimes both, or a bond of both). Interfaces are twins when (1) their names
share the ``p<bus>s<slot>f<fn>[np<port>]`` tail under different domains, (2) they are the netdevs
of HCAs whose names pair that way, or (3) their HCAs share a ``sys_image_guid`` (one adapter) and
their PCI functions share bus:device.function under different domains; HCAs with different
``sys_image_guid`` are never twins. Sources: tests/fixtures/fabric/README.md. NCCL_IB_GID_INDEX is
never produced: NCCL picks the RoCE v2 GID itself.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

# POSIX sh, no interpolated value, no single quote (shlex.join keeps it one readable word),
# read-only, always exits 0: failures are data (each command's status follows its output).
FABRIC_SCRIPT = r"""run() {
  echo "@@ $1"
  shift
  out=$("$@" 2>&1)
  rc=$?
  [ -z "$out" ] || printf "%s\n" "$out"
  echo "@@ rc $rc"
}
run ip-addr ip -d -j addr show
run rdma-dev rdma -j dev show
run rdma-link rdma -j link show
echo "@@ sysfs"
for d in /sys/class/net/*/device/infiniband/*; do
  [ -e "$d" ] || continue
  n=${d%/device/infiniband/*}
  printf "ibdev\t%s\t%s\t%s\n" "${n##*/}" "${d##*/}" "$(cat "$n/dev_port" 2>/dev/null)"
done
for u in /dev/infiniband/uverbs*; do
  [ -e "$u" ] && printf "uverbs\t%s\n" "$u"
done
echo "@@ end"
exit 0
"""
FABRIC_ARGV: tuple[str, ...] = ("sh", "-c", FABRIC_SCRIPT)

_IP, _RDMA_DEV, _RDMA_LINK, _SYSFS, _END = "ip-addr", "rdma-dev", "rdma-link", "sysfs", "end"
_COMMANDS = {
    _IP: "ip -d -j addr show",
    _RDMA_DEV: "rdma -j dev show",
    _RDMA_LINK: "rdma -j link show",
}
_MARKER = re.compile(r"@@ ([a-z-]{1,20})(?: (-?\d{1,6}))?")
# en[P<domain>]p<bus>s<slot>f<function>[n<phys_port_name>|d<dev_port>]; roce... for the HCAs.
_TWIN_NAME = re.compile(
    r"(?P<head>[a-z]+?)(?:P(?P<domain>\d+))?(?P<tail>p\d+s\d+f\d+(?:n[0-9a-z]+|d\d+)?)"
)
_PCI = re.compile(r"(?P<domain>[0-9a-fA-F]{4,8}):(?P<bdf>[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])")
_UVERBS = "/dev/infiniband/uverbs"
_UP = "UP"
# Link kinds whose `link` is a peer, not a parent the interface's traffic goes through.
_PEER_KINDS = frozenset({"veth", "vxcan", "netkit"})

Rdma = Literal["present", "none", "unknown"]


@dataclass(frozen=True)
class Address:
    """One ``addr_info`` entry of ``ip -j addr``."""

    family: str  # "inet" or "inet6"
    local: str
    prefixlen: int | None = None
    scope: str | None = None


@dataclass(frozen=True)
class Interface:
    """One netdev as ``ip -d -j addr`` shows it."""

    name: str
    mtu: int | None = None
    operstate: str | None = None  # UP, DOWN, LOWERLAYERDOWN, UNKNOWN (lo, some virtual), ...
    addresses: tuple[Address, ...] = ()
    master: str | None = None  # the bond or bridge it is enslaved to
    link: str | None = None  # a VLAN's parent or a veth's peer (see ``kind``)
    pci: str | None = None  # e.g. "0000:01:00.1" (``parentdev`` on the pci bus)
    kind: str | None = None  # linkinfo.info_kind: vlan, bond, bridge, veth, ...; None: physical
    link_type: str | None = None  # ether, loopback, infiniband, ...

    @property
    def up(self) -> bool:
        return self.operstate == _UP

    @property
    def parent(self) -> str | None:
        """The interface this one sends through (a VLAN's), not a veth's peer."""
        return self.link if self.link and self.kind not in _PEER_KINDS else None


@dataclass(frozen=True)
class Hca:
    """One port of one RDMA device (HCA) and the netdev behind it."""

    name: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED, ... ("UNKNOWN" when not given)
    link_layer: str  # "Ethernet" (RoCE), "InfiniBand", or "" when unknown
    netdev: str | None = None
    netdevs: tuple[str, ...] = ()  # every netdev of this port (IPoIB children included)
    pci: str | None = None  # its netdev's PCI function
    sys_image_guid: str | None = None
    physical_state: str | None = None  # LINK_UP, DISABLED, POLLING, ...

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"


@dataclass(frozen=True)
class CommandRun:
    """One command of the probe: its exit status and what it printed when that was not data."""

    command: str
    rc: int | None  # None: the output ends before its status
    message: str = ""  # stderr-like text (e.g. "Failed to open NETLINK_RDMA socket")

    @property
    def failed(self) -> bool:
        return self.rc != 0

    def describe(self) -> str:
        status = "did not finish" if self.rc is None else f"exited {self.rc}"
        if self.rc == 127:
            status = "is not installed (exit 127)"
        return f"`{self.command}` {status}" + (f": {self.message}" if self.message else "")


@dataclass(frozen=True)
class FabricFacts:
    """What one node's fabric looks like from the fabric IP's point of view."""

    fabric_ip: str
    interface: str | None = None  # the interface that owns the fabric IP
    mtu: int | None = None
    operstate: str | None = None
    twins: tuple[str, ...] = ()  # the same physical port's other netdevs (not ``interface``)
    members: tuple[str, ...] = ()  # a bond's slaves or a VLAN's parent, when the IP is on one
    hcas: tuple[Hca, ...] = ()  # every HCA port of the node
    rdma_devices: tuple[str, ...] = ()  # /dev/infiniband/uverbs* paths
    interfaces: tuple[Interface, ...] = ()
    also_on: tuple[str, ...] = ()  # other interfaces that carry the fabric IP, not twins
    complete: bool = False  # the output reached the end marker
    runs: tuple[CommandRun, ...] = field(default=())  # ip, rdma dev, rdma link: as they ran

    @property
    def rdma_checked(self) -> bool:
        """Whether ``rdma -j link show`` answered (with HCAs or without)."""
        link = _COMMANDS[_RDMA_LINK]
        return any(r.command == link and not r.failed and not r.message for r in self.runs)

    @property
    def rdma(self) -> Rdma:
        """``present``: HCAs listed; ``none``: no RDMA here; ``unknown``: could not check."""
        if self.hcas:
            return "present"
        if not self.rdma_checked and self.rdma_devices:
            return "unknown"
        return "none"

    @property
    def fabric_hcas(self) -> tuple[Hca, ...]:
        """The HCA ports behind the fabric interface, its twins and its members, any state."""
        group = {self.interface, *self.twins, *self.members} - {None}
        return tuple(h for h in self.hcas if group.intersection(h.netdevs))

    @property
    def nccl_hcas(self) -> tuple[Hca, ...]:
        """The ACTIVE fabric HCAs, PCI domain first: the same order on every node."""
        return tuple(h for h in self.fabric_hcas if h.active)

    @property
    def nccl_ib_hca(self) -> str | None:
        """NCCL_IB_HCA: exact names (``=``: ``mlx5_1`` alone would also match ``mlx5_10``) and
        ports; None when no fabric HCA is ACTIVE (leave NCCL to its sockets)."""
        hcas = self.nccl_hcas
        return "=" + ",".join(f"{h.name}:{h.port}" for h in hcas) if hcas else None

    @property
    def socket_ifnames(self) -> tuple[str, ...]:
        """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME names: the interface, then the twins that are
        up and carry an address of the fabric IP's family (Gloo fails on a name it finds no
        address for). Exact names: NCCL wants a leading ``=`` to match them exactly."""
        if self.interface is None:
            return ()
        family = _family(self.fabric_ip)
        by_name = {i.name: i for i in self.interfaces}
        usable = [
            t
            for t in self.twins
            if t in by_name and by_name[t].up and _has_address(by_name[t], family)
        ]
        return (self.interface, *usable)

    def problems(self) -> tuple[str, ...]:
        """Human phrases for what would make NCCL slow or stall, or what could not be checked;
        empty when all is well. A node without RDMA (``rdma == "none"``) is no problem: its NCCL
        uses sockets, as it must."""
        found: list[str] = []
        if not self.interfaces:
            ip = next((r for r in self.runs if r.command == _COMMANDS[_IP]), None)
            why = ip.describe() if ip and ip.failed else "ip -d -j addr show printed nothing usable"
            found.append(f"the probe printed no interface list ({why})")
        elif not self.complete:
            found.append("the probe's output ends early: the facts may be partial")
        if self.interface is None:
            found.append(f"the fabric IP {self.fabric_ip} is on no interface")
        elif self.operstate not in (_UP, "UNKNOWN"):
            found.append(f"the fabric interface {self.interface} is {self.operstate}")
        if self.also_on:
            found.append(
                f"the fabric IP {self.fabric_ip} is also on {', '.join(self.also_on)} "
                f"(not a twin of {self.interface})"
            )
        found.extend(self._hca_problems())
        found.extend(self._mtu_problems())
        return tuple(found)

    def _hca_problems(self) -> list[str]:
        if self.rdma == "unknown":
            failed = [r.describe() for r in self.runs if r.command.startswith("rdma") and r.failed]
            devices = ", ".join(d.rsplit("/", 1)[-1] for d in self.rdma_devices)
            return [
                f"could not check the HCAs: {'; '.join(failed) or 'rdma printed nothing'}, "
                f"yet /dev/infiniband holds {devices}"
            ]
        if not self.hcas or self.interface is None:
            return []
        fabric, active = self.fabric_hcas, self.nccl_hcas
        if not fabric:
            return [f"no HCA serves {self.interface}: NCCL will use TCP sockets"]
        found = [f"HCA {_port_name(h, self.hcas)} is {h.state}" for h in fabric if not h.active]
        if not active:
            found.append(f"no HCA of {self.interface} is ACTIVE: NCCL will use TCP sockets")
        elif len(active) == 1 and len(fabric) == 2 and self.twins:
            found.append(
                f"only one of the twins ({active[0].name}) is ACTIVE: "
                "NCCL will use half the bandwidth"
            )
        elif len(active) < len(fabric):
            found.append(
                f"only {len(active)} of the {len(fabric)} HCAs of {self.interface} are ACTIVE "
                f"({', '.join(h.name for h in active)}): NCCL will use part of the bandwidth"
            )
        if not self.rdma_devices:
            found.append(
                "no /dev/infiniband/uverbs* device nodes: a container cannot open the HCAs"
            )
        return found

    def _mtu_problems(self) -> list[str]:
        by_name = {i.name: i for i in self.interfaces}
        ports = [by_name[n] for n in (self.interface, *self.twins) if n in by_name]
        ports = [i for i in ports if i.up and i.mtu is not None]
        if len({i.mtu for i in ports}) > 1:
            listed = ", ".join(f"{i.name} {i.mtu}" for i in ports)
            return [f"the twins' MTUs differ ({listed})"]
        return []


def parse_fabric(stdout: str, fabric_ip: str) -> FabricFacts:
    """Parse :data:`FABRIC_ARGV`'s output; never raises (garbage gives empty facts)."""
    sections = _sections(stdout)
    runs = tuple(
        _run(command, *sections[name]) for name, command in _COMMANDS.items() if name in sections
    )
    interfaces = tuple(_interfaces(_json_list(sections.get(_IP, ([], None))[0])[0]))
    devices = _by_name(_json_list(sections.get(_RDMA_DEV, ([], None))[0])[0])
    links = _json_list(sections.get(_RDMA_LINK, ([], None))[0])[0]
    ibdevs, uverbs = _sysfs(sections.get(_SYSFS, ([], None))[0])
    pci = {i.name: i.pci for i in interfaces if i.pci}
    hcas = tuple(
        sorted(
            (hca for link in links if (hca := _hca(link, devices, ibdevs, pci)) is not None),
            key=lambda h: (_domain(h.name, h.pci), h.name, h.port),
        )
    )
    hcas = tuple({(h.name, h.port): h for h in hcas}.values())
    return _facts(fabric_ip, interfaces, hcas, uverbs, _END in sections, runs)


def _facts(
    fabric_ip: str,
    interfaces: tuple[Interface, ...],
    hcas: tuple[Hca, ...],
    uverbs: tuple[str, ...],
    complete: bool,
    runs: tuple[CommandRun, ...],
) -> FabricFacts:
    by_name = {i.name: i for i in interfaces}
    twin_of = _TwinRule(interfaces, hcas)
    facts = FabricFacts(
        fabric_ip=fabric_ip,
        hcas=hcas,
        rdma_devices=uverbs,
        interfaces=interfaces,
        complete=complete,
        runs=runs,
    )
    owners = _owners(fabric_ip, interfaces)
    if not owners:
        return facts
    owner = next((i for i in owners if i.up), owners[0])
    members = [i.name for i in interfaces if i.master == owner.name]
    if owner.parent in by_name and owner.parent != owner.name:
        members.append(owner.parent)
    group = {owner.name, *members}
    twins = {t for g in group for t in twin_of(g)} - group
    return replace(
        facts,
        interface=owner.name,
        mtu=owner.mtu,
        operstate=owner.operstate,
        twins=_canonical(twins, by_name),
        members=_canonical(set(members), by_name),
        also_on=tuple(i.name for i in owners if i.name not in group | twins),
    )


def _owners(fabric_ip: str, interfaces: tuple[Interface, ...]) -> list[Interface]:
    """The interfaces that carry the IP; else a loopback interface whose prefix holds it (Linux
    routes a loopback address's whole prefix locally: 127.0.0.1/8 makes 127.0.0.5 local)."""
    wanted = _normal_ip(fabric_ip)
    owners = [i for i in interfaces if any(_normal_ip(a.local) == wanted for a in i.addresses)]
    if owners:
        return owners
    return [
        i
        for i in interfaces
        if i.link_type == "loopback" and any(_in_prefix(wanted, a) for a in i.addresses)
    ]


class _TwinRule:
    """The twin relation over every known netdev (see the module docstring)."""

    def __init__(self, interfaces: Iterable[Interface], hcas: tuple[Hca, ...]) -> None:
        self.pci = {i.name: i.pci for i in interfaces if i.pci}
        self.hcas_of: dict[str, list[Hca]] = {}
        for hca in hcas:
            for netdev in hca.netdevs:
                self.hcas_of.setdefault(netdev, []).append(hca)
        self.names = {i.name for i in interfaces} | set(self.hcas_of)

    def __call__(self, name: str) -> set[str]:
        return {other for other in self.names if self.twins(name, other)}

    def twins(self, a: str, b: str) -> bool:
        if a == b:
            return False
        hcas_a, hcas_b = self.hcas_of.get(a, []), self.hcas_of.get(b, [])
        guids_a = {h.sys_image_guid for h in hcas_a if h.sys_image_guid}
        guids_b = {h.sys_image_guid for h in hcas_b if h.sys_image_guid}
        if guids_a and guids_b and not guids_a & guids_b:
            return False  # two adapters
        if _name_twins(a, b):
            return True
        if any(_name_twins(x.name, y.name) for x in hcas_a for y in hcas_b):
            return True
        return bool(guids_a & guids_b) and _pci_twins(self.pci.get(a), self.pci.get(b))


def _sections(text: str) -> dict[str, tuple[list[str], int | None]]:
    """Lines under each marker and the ``@@ rc N`` that closes it (None when missing)."""
    sections: dict[str, tuple[list[str], int | None]] = {}
    current: str | None = None
    for line in str(text).splitlines():
        marker = _MARKER.fullmatch(line.strip())
        if marker and marker[1] == "rc":
            if current is not None and marker[2] is not None:
                sections[current] = (sections[current][0], int(marker[2]))
            current = None
        elif marker:
            current = marker[1]
            sections.setdefault(current, ([], None))
        elif current is not None:
            sections[current][0].append(line)
    return sections


def _json_list(lines: list[str]) -> tuple[list[object], str]:
    """The JSON array in a section, and the other text (a tool's error message)."""
    text = "\n".join(lines).strip()
    start = text.find("[")
    if start < 0:
        return [], text
    try:
        data, end = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return [], text
    if not isinstance(data, list):
        return [], text
    return data, (text[:start] + text[end:]).strip()


def _run(command: str, lines: list[str], rc: int | None) -> CommandRun:
    data, rest = _json_list(lines)
    message = " ".join(rest.split())[:300]
    return CommandRun(command, rc, message if (rc != 0 or not data) else "")


def _interfaces(data: list[object]) -> list[Interface]:
    found: dict[str, Interface] = {}
    for item in data:
        if isinstance(item, Mapping) and isinstance(name := item.get("ifname"), str) and name:
            found.setdefault(name, _interface(name, item))
    return list(found.values())


def _interface(name: str, item: Mapping[str, object]) -> Interface:
    addresses = []
    info = item.get("addr_info")
    for entry in info if isinstance(info, list) else []:
        if isinstance(entry, Mapping) and isinstance(local := entry.get("local"), str):
            addresses.append(
                Address(
                    family=_str(entry.get("family")) or "",
                    local=local,
                    prefixlen=_json_int(entry.get("prefixlen")),
                    scope=_str(entry.get("scope")),
                )
            )
    linkinfo = item.get("linkinfo")
    kind = _str(linkinfo.get("info_kind")) if isinstance(linkinfo, Mapping) else None
    parent = _str(item.get("parentdev")) if item.get("parentbus") == "pci" else None
    return Interface(
        name=name,
        mtu=_json_int(item.get("mtu")),
        operstate=_str(item.get("operstate")),
        addresses=tuple(addresses),
        master=_str(item.get("master")),
        link=_str(item.get("link")),
        pci=parent,
        kind=kind,
        link_type=_str(item.get("link_type")),
    )


def _by_name(data: list[object]) -> dict[str, Mapping[str, object]]:
    return {
        name: item
        for item in data
        if isinstance(item, Mapping) and isinstance(name := item.get("ifname"), str) and name
    }


def _sysfs(lines: list[str]) -> tuple[dict[str, list[tuple[str, int | None]]], tuple[str, ...]]:
    """``ibdev`` rows as HCA -> [(netdev, dev_port)], and the uverbs device paths."""
    ibdevs: dict[str, list[tuple[str, int | None]]] = {}
    uverbs: set[str] = set()
    for line in lines:
        cells = [cell.strip() for cell in line.rstrip("\r\n").split("\t")] + ["", "", ""]
        if cells[0] == "ibdev" and cells[1] and cells[2]:
            ibdevs.setdefault(cells[2], []).append((cells[1], _int(cells[3])))
        elif cells[0] == "uverbs" and cells[1].startswith(_UVERBS):
            uverbs.add(cells[1])
    return ibdevs, tuple(sorted(uverbs))


def _hca(
    link: object,
    devices: Mapping[str, Mapping[str, object]],
    ibdevs: Mapping[str, list[tuple[str, int | None]]],
    pci: Mapping[str, str],
) -> Hca | None:
    if not isinstance(link, Mapping):
        return None
    name, port = _str(link.get("ifname")), _json_int(link.get("port"))
    if name is None or port is None:
        return None
    name = name.rsplit("/", 1)[0]  # iproute2 before 5.x spelled it "mlx5_0/1"
    netdev = _str(link.get("netdev"))
    from_sysfs = [n for n, dev_port in ibdevs.get(name, []) if dev_port in (None, port - 1)]
    netdevs = sorted({n for n in [netdev, *from_sysfs] if n}, key=lambda n: (len(n), n))
    infiniband = "lid" in link or "subnet_prefix" in link  # only IB ports have them
    layer = "InfiniBand" if infiniband else ("Ethernet" if netdev else "")
    device = devices.get(name, {})
    return Hca(
        name=name,
        port=port,
        state=(_str(link.get("state")) or "UNKNOWN").upper(),
        link_layer=layer,
        netdev=netdev or (netdevs[0] if netdevs else None),
        netdevs=tuple(netdevs),
        pci=next((pci[n] for n in netdevs if n in pci), None),
        sys_image_guid=_str(device.get("sys_image_guid")),
        physical_state=_str(link.get("physical_state")),
    )


def _name_twins(a: str, b: str) -> bool:
    match_a, match_b = _TWIN_NAME.fullmatch(a), _TWIN_NAME.fullmatch(b)
    if not match_a or not match_b:
        return False
    same = match_a.group("head", "tail") == match_b.group("head", "tail")
    return same and int(match_a["domain"] or 0) != int(match_b["domain"] or 0)


def _pci_twins(a: str | None, b: str | None) -> bool:
    match_a = _PCI.fullmatch(a) if a else None
    match_b = _PCI.fullmatch(b) if b else None
    if not match_a or not match_b:
        return False
    same_function = match_a["bdf"].lower() == match_b["bdf"].lower()
    return same_function and int(match_a["domain"], 16) != int(match_b["domain"], 16)


def _domain(name: str, pci: str | None) -> int:
    """The PCI domain, from the PCI address, else from a ``P<domain>`` name, else 0."""
    if pci and (match := _PCI.fullmatch(pci)):
        return int(match["domain"], 16)
    if match := _TWIN_NAME.fullmatch(name):
        return int(match["domain"] or 0)
    return 0


def _canonical(names: set[str], by_name: Mapping[str, Interface]) -> tuple[str, ...]:
    def key(name: str) -> tuple[int, str]:
        interface = by_name.get(name)
        return _domain(name, interface.pci if interface else None), name

    return tuple(sorted(names, key=key))


def _port_name(hca: Hca, hcas: Iterable[Hca]) -> str:
    """``name``, or ``name port N`` when several ports of that HCA are listed."""
    ports = sum(1 for h in hcas if h.name == hca.name)
    return f"{hca.name} port {hca.port}" if ports > 1 else hca.name


def _normal_ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return text.strip()


def _in_prefix(ip: str, address: Address) -> bool:
    try:
        network = ipaddress.ip_network(f"{address.local}/{address.prefixlen}", strict=False)
        return ipaddress.ip_address(ip) in network
    except ValueError:
        return False


def _family(ip: str) -> str | None:
    try:
        return "inet" if ipaddress.ip_address(ip.strip()).version == 4 else "inet6"
    except ValueError:
        return None


def _has_address(interface: Interface, family: str | None) -> bool:
    return any(
        a.family == family and not (family == "inet6" and a.scope == "link")
        for a in interface.addresses
    )


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _json_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
