"""The test bed's RDMA fabric: Spark-like twin interfaces, HCAs for the ``rdma`` stand-in, and
real verbs device nodes.

Per node (opt-in, ``TestBed.up(rdma={"node-1": "both", ...})``), on the host:

- ``both``: twins ``enp<bus>s0f1np1`` (the node's IP as /32, UP, MTU 9000) and
  ``enP2p<bus>s0f1np1`` (UP, no address), each a veth whose peer (``vrd<bus>a``/``vrd<bus>b``)
  gives it carrier; HCAs ``rocep<bus>s0f1`` and ``roceP2p<bus>s0f1`` ACTIVE behind them.
- ``one-down``: the same with the P2 twin unplugged (its peer down: NO-CARRIER, its HCA DOWN).
- ``down``: both twins unplugged (the fabric interface is LOWERLAYERDOWN, both HCAs DOWN).
- ``none``: a plain NIC ``enp<bus>s0`` with the IP, a kernel with RDMA support, no HCA.
- ``no-kernel``: the same NIC, a kernel without RDMA (``rdma`` fails as on this machine).

Every bed node shares the host's network namespace and /dev, so interface names must be unique
on the host: each node gets its own PCI "bus" number, allocated under a lock in a registry
(``/tmp/vrd-fabric.json``) that also survives killed sessions (entries whose bed directory is
gone are cleaned up by the next allocation). Nodes see each other's interfaces in ``ip addr``,
but ``rdma`` on a node lists only that node's HCAs, and the twin rule pairs only one bus's names.

The verbs device nodes ``/dev/infiniband/uverbs<N>`` (char 231:192+N) are real, made with mknod
when a bed has an RDMA node and the host has no /dev/infiniband (a real RDMA host is left
alone). They are shared by every node and every bed on the host and removed with the last bed
that uses them: which node "has" RDMA is decided by the HCAs its ``rdma`` reports, not by /dev.

A node's interfaces and address stay across power_off/reboot (hardware, and an address set in
netplan as NVIDIA's playbook does); :meth:`NodeFabric.lose_address` emulates an address set by
hand that a reboot forgot, :meth:`NodeFabric.set_mtu` an MTU it forgot. ``ip route get`` of
the IP stays ``local`` either way: 127/8 is lo's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.testbed.standins import rdma

PRESETS = ("both", "one-down", "down", "none", "no-kernel")
# Host-wide on purpose: interface names and /dev are host-wide, whatever bed or session.
REGISTRY = Path("/tmp/vrd-fabric.json")
LOCK = Path("/tmp/vrd-fabric.lock")
DEV_DIR = Path("/dev/infiniband")
UVERBS_MAJOR, UVERBS_MINOR_BASE = 231, 192
DOMAIN = 2  # a Spark's second PCIe link of a port sits in PCI domain 0002
SPARK_MTU = 9000
MAX_BUS = 255


@dataclass(frozen=True)
class NodeFabric:
    """One node's emulated fabric hardware, from its preset and bus number."""

    preset: str
    bus: int
    ip: str
    state_file: Path

    @property
    def twins(self) -> bool:
        return self.preset in ("both", "one-down", "down")

    @property
    def interface(self) -> str:
        """The netdev that carries the node's IP."""
        return f"enp{self.bus}s0f1np1" if self.twins else f"enp{self.bus}s0"

    @property
    def twin(self) -> str | None:
        return f"enP{DOMAIN}p{self.bus}s0f1np1" if self.twins else None

    @property
    def hca_names(self) -> tuple[str, ...]:
        return (f"rocep{self.bus}s0f1", f"roceP{DOMAIN}p{self.bus}s0f1") if self.twins else ()

    @property
    def nccl_ib_hca(self) -> str | None:
        """What the fabric parser should find: every HCA whose twin is plugged in."""
        names = [h for h, up in zip(self.hca_names, self._plugged(), strict=False) if up]
        return "=" + ",".join(f"{n}:1" for n in names) if names else None

    def _plugged(self) -> tuple[bool, bool]:
        return {"both": (True, True), "one-down": (True, False)}.get(self.preset, (False, False))

    def _ports(self) -> list[tuple[str, str, bool, str]]:
        """(netdev, veth peer, plugged in, MAC) per port of the node."""
        mac = f"3c:6d:66:a1:{self.bus:02x}"
        if not self.twins:
            return [(self.interface, f"vrd{self.bus}a", True, f"{mac}:10")]
        first, second = self._plugged()
        return [
            (self.interface, f"vrd{self.bus}a", first, f"{mac}:31"),
            (str(self.twin), f"vrd{self.bus}b", second, f"{mac}:35"),
        ]

    def host_names(self) -> tuple[str, ...]:
        """Every netdev this node puts on the host (the twins and their veth peers)."""
        return tuple(name for port in self._ports() for name in port[:2])

    def create(self) -> None:
        """Make the interfaces, give the IP, write the state the ``rdma`` stand-in reads."""
        mtu = SPARK_MTU if self.twins else 1500
        for name, peer, plugged, mac in self._ports():
            _ip("link", "add", name, "address", mac, "mtu", str(mtu), "type", "veth", "peer",
                "name", peer, "mtu", str(mtu))  # fmt: skip
            if plugged:
                _ip("link", "set", peer, "up")
            _ip("link", "set", name, "up")
        _ip("addr", "add", f"{self.ip}/32", "dev", self.interface)
        rdma.write_state(self.state_file, self.rdma_state())

    def rdma_state(self) -> rdma.NodeRdma:
        guid = f"3c6d:6603:00a1:{self.bus:02x}30"
        hcas = tuple(
            rdma.Hca(
                ifindex=index,
                name=hca,
                netdev=netdev,
                node_guid=f"3c6d:6603:00a1:{self.bus:02x}{mac[-2:]}",
                sys_image_guid=guid,
                pci=f"{DOMAIN * (index % 2):04x}:{self.bus:02x}:00.1",
            )
            for index, (hca, (netdev, _, _, mac)) in enumerate(
                zip(self.hca_names, self._ports(), strict=False)
            )
        )
        return rdma.NodeRdma(kernel=self.preset != "no-kernel", hcas=hcas)

    def lose_address(self) -> None:
        """The IP set by hand is gone (what a reboot does to a Spark without netplan)."""
        _ip("addr", "del", f"{self.ip}/32", "dev", self.interface, check=False)

    def set_mtu(self, mtu: int = SPARK_MTU) -> None:
        """The fabric interface's MTU (a reboot that lost a hand-set 9000 leaves 1500)."""
        _ip("link", "set", self.interface, "mtu", str(mtu))

    def remove(self) -> None:
        for name, *_ in self._ports():
            _ip("link", "del", name, check=False)  # takes its peer along
        self.state_file.unlink(missing_ok=True)


# --------------------------------------------------------------------------- host registry


@contextlib.contextmanager
def _registry() -> Iterator[dict]:
    """The host-wide registry, locked for the duration (beds come up in parallel)."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(REGISTRY.read_text()) if REGISTRY.exists() else {}
        except ValueError:
            data = {}
        data.setdefault("buses", {})
        data.setdefault("uverbs", {"created": [], "made_dir": False, "owners": []})
        _prune(data)
        yield data
        REGISTRY.write_text(json.dumps(data, indent=1))


def _prune(data: dict) -> None:
    """Forget (and clean up after) beds whose directory is gone: a killed session's."""
    for bus, entry in list(data["buses"].items()):
        if not Path(entry["root"]).exists():
            for name in entry["names"]:
                _ip("link", "del", name, check=False)
            del data["buses"][bus]
    uverbs = data["uverbs"]
    uverbs["owners"] = [root for root in uverbs["owners"] if Path(root).exists()]
    if not uverbs["owners"]:
        _remove_uverbs(uverbs)


def sweep() -> None:
    """Clean up after killed sessions' beds now (every registry access does it too)."""
    with _registry():
        pass


def allocate_bus(root: Path, names_of: Callable[[int], tuple[str, ...]]) -> int:
    """The lowest bus number whose interface names exist nowhere on the host."""
    with _registry() as data:
        existing = set(os.listdir("/sys/class/net"))
        for bus in range(1, MAX_BUS + 1):
            names = names_of(bus)
            if str(bus) in data["buses"] or existing & set(names):
                continue
            data["buses"][str(bus)] = {"root": str(root), "names": list(names)}
            return bus
    raise RuntimeError("no free bus number for the bed's fabric interfaces")


def release_bus(bus: int) -> None:
    with _registry() as data:
        data["buses"].pop(str(bus), None)


def claim_uverbs(root: Path, count: int) -> list[str]:
    """Make /dev/infiniband/uverbs0..count-1 unless this host has its own; returns the paths."""
    with _registry() as data:
        uverbs = data["uverbs"]
        if DEV_DIR.exists() and not uverbs["owners"] and not uverbs["created"]:
            return sorted(str(p) for p in DEV_DIR.glob("uverbs*"))  # a real RDMA host
        if not DEV_DIR.exists():
            DEV_DIR.mkdir(mode=0o755)
            uverbs["made_dir"] = True
        for index in range(count):
            path = DEV_DIR / f"uverbs{index}"
            if not path.exists():
                device = os.makedev(UVERBS_MAJOR, UVERBS_MINOR_BASE + index)
                os.mknod(path, 0o666 | stat.S_IFCHR, device)
                os.chmod(path, 0o666)  # mknod's mode is masked by the umask
                uverbs["created"].append(str(path))
        if str(root) not in uverbs["owners"]:
            uverbs["owners"].append(str(root))
        return sorted(str(p) for p in DEV_DIR.glob("uverbs*"))


def release_uverbs(root: Path) -> None:
    with _registry() as data:
        uverbs = data["uverbs"]
        uverbs["owners"] = [owner for owner in uverbs["owners"] if owner != str(root)]
        if not uverbs["owners"]:
            _remove_uverbs(uverbs)


def _remove_uverbs(uverbs: dict) -> None:
    for path in uverbs["created"]:
        Path(path).unlink(missing_ok=True)
    if uverbs["made_dir"]:
        with contextlib.suppress(OSError):
            DEV_DIR.rmdir()  # only if empty: never what a real driver made
    uverbs.update(created=[], made_dir=False)


def _ip(*args: str, check: bool = True) -> None:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
