"""NCCL as one rank of the vLLM stand-in sees it: which network it takes, and its INFO/WARN log.

Each rank decides by itself, from what its own process can see, the way NCCL 2.28.9 does
(``src/transport/net_ib.cc``, ``net_socket.cc``, ``bootstrap.cc``, ``misc/socket.cc``):

- interfaces: the real ``getifaddrs()`` of the process (running ones, IPv4 before IPv6), matched
  against ``NCCL_SOCKET_IFNAME`` (prefixes; ``=`` exact; ``^`` excluded) or, unset, ``ib*``
  first, then anything but ``docker*``/``lo*``/``virbr*``, then docker, then lo. None:
  ``Bootstrap : no socket interface found`` and the rank fails.
- IB devices: the node's HCAs (``rdma.read_state``: the bed's state file of this node) whose
  verbs device node ``/dev/infiniband/uverbs<ifindex>`` exists in this container (libibverbs
  skips devices it cannot stat), whose port is ACTIVE (carrier on its netdev), selected by
  ``NCCL_IB_HCA`` (prefixes or ``=`` exact names, ``:port``, ``^`` to exclude). None: ``NET/IB :
  No device found.`` and NCCL falls back to sockets.
- pinned memory: with IB, registering NCCL's buffers pins memory (``ibv_reg_mr``); the kernel
  refuses beyond ``RLIMIT_MEMLOCK`` unless the process has ``CAP_IPC_LOCK``. NCCL does not fall
  back then: the rank logs IB, then ``Call to ibv_reg_mr_iova2 failed with error Cannot allocate
  memory`` when it connects, and fails (NVIDIA/nccl-tests#206 shows the same on real HCAs).

Lines carry NCCL's prefix ``host:pid:tid [cudaDev] NCCL INFO``; WARN lines a blank line, a
timestamp and the source position before. ``NCCL_DEBUG`` unset prints nothing, ``WARN`` only the
warnings, ``INFO`` the lines of the subsystems in ``NCCL_DEBUG_SUBSYS`` (default INIT,BOOTSTRAP,
ENV). The texts follow tests/fixtures/nccl/h200-x2 and NCCL's sources.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

try:
    from . import rdma
except ImportError:  # run as a plain script
    import rdma  # type: ignore[no-redef]

VERSION = "2.28.9+cuda13.0"
VERSION_NUMBER = "2.28.9"
CUDA_DRIVER = 13000
MAX_IFS = 16
PINNED_NEED = 16 << 20  # NCCL_BUFFSIZE (4 MiB) x 2 channels x send and receive
CAP_IPC_LOCK = 14
IFF_RUNNING = 0x40
DEV_DIR = Path("/dev/infiniband")

INIT, NET, ENV, BOOTSTRAP, P2P, ALL = 1, 16, 128, 4096, 4, ~0
_NAMES = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL", "PROXY",
          "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS")  # fmt: skip
SUBSYS = {name: 1 << bit for bit, name in enumerate(_NAMES)} | {"ALL": ALL}
LEVELS = {"VERSION": 1, "WARN": 2, "INFO": 3, "ABORT": 3, "TRACE": 4}

INVALID_USAGE = (
    "NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version {v}\n"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n{last}"
)
SYSTEM_ERROR = (
    "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version {v}\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
    "device error. \nLast error:\n{last}"
)


class NcclError(RuntimeError):
    """What PyTorch raises when NCCL fails (its DistBackendError text)."""


# --------------------------------------------------------------------------- logging


@dataclass
class Log:
    """NCCL's debug output for one process."""

    env: Mapping[str, str]
    dev: int = 0
    write: Callable[[str], None] = print

    def __post_init__(self) -> None:
        self.level = LEVELS.get(self.env.get("NCCL_DEBUG", "").upper(), 0)
        self.mask = _subsys_mask(self.env.get("NCCL_DEBUG_SUBSYS"))
        self.host = socket.gethostname()
        self.pid = os.getpid()

    def _prefix(self) -> str:
        return f"{self.host}:{self.pid}:{threading.get_native_id()} [{self.dev}]"

    def info(self, mask: int, message: str) -> None:
        if self.level >= LEVELS["INFO"] and mask & self.mask:
            self.write(f"{self._prefix()} NCCL INFO {message}")

    def version(self) -> None:
        """showVersion(): a bare line at the VERSION and WARN levels, an INFO line above."""
        if self.level >= LEVELS["INFO"]:
            self.write(f"{self._prefix()} NCCL INFO NCCL version {VERSION}")
        elif self.level >= LEVELS["VERSION"]:
            self.write(f"NCCL version {VERSION}")

    def warn(self, where: str, message: str) -> None:
        if self.level >= LEVELS["WARN"]:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self.write(f"\n[{stamp}] {self._prefix()} {where} NCCL WARN {message}")


def _subsys_mask(spec: str | None) -> int:
    if spec is None:
        return INIT | BOOTSTRAP | ENV
    invert = spec.startswith("^")
    mask = ALL if invert else 0
    for name in spec.removeprefix("^").split(","):
        bit = SUBSYS.get(name.strip().upper(), 0)
        mask = mask & ~bit if invert else mask | bit
    return mask


# --------------------------------------------------------------------------- interfaces


def _ifaddrs_type() -> type[ctypes.Structure]:
    """struct ifaddrs; made per call: Ray ships this module by value, and ctypes types do not
    pickle."""

    class Ifaddrs(ctypes.Structure):
        pass

    Ifaddrs._fields_ = [
        ("ifa_next", ctypes.POINTER(Ifaddrs)),
        ("ifa_name", ctypes.c_char_p),
        ("ifa_flags", ctypes.c_uint),
        ("ifa_addr", ctypes.c_void_p),
        ("ifa_netmask", ctypes.c_void_p),
        ("ifa_ifu", ctypes.c_void_p),
        ("ifa_data", ctypes.c_void_p),
    ]
    return Ifaddrs


def running_addresses() -> list[tuple[str, str]]:
    """(interface, NCCL's address text) per IPv4/IPv6 address of a running interface, in
    getifaddrs() order (what NCCL walks)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_ifaddrs_type())()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.ifa_addr and item.ifa_flags & IFF_RUNNING:
                text = _address_text(ctypes.string_at(item.ifa_addr, 28), item.ifa_name.decode())
                if text:
                    found.append((item.ifa_name.decode(), text))
            entry = item.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def _address_text(raw: bytes, name: str) -> str | None:
    """ncclSocketToString: ``192.0.2.2<0>``, ``fe80::1%eth0<0>``; None for other families and
    IPv6 loopback (NCCL skips it)."""
    family = int.from_bytes(raw[:2], sys.byteorder)
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}<0>"
    if family == socket.AF_INET6:
        address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        if address == "::1":
            return None
        scope = int.from_bytes(raw[24:28], sys.byteorder)
        return f"{address}%{name}<0>" if scope else f"{address}<0>"
    return None


def _parse_list(spec: str) -> tuple[bool, bool, list[tuple[str, int]]]:
    """NCCL's parseStringList with its ``^``/``=`` prefixes: (exclude, exact, [(name, port)])."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    spec = spec.removeprefix("=")
    items = []
    for part in spec.split(","):
        name, colon, port = part.partition(":")
        if name:
            items.append((name, int(port) if colon and port.isdigit() else -1))
    return exclude, exact, items


def _matches(name: str, port: int, items: list[tuple[str, int]], exact: bool) -> bool:
    if not items:
        return True
    return any(
        (name == want if exact else name.startswith(want)) and want_port in (-1, port)
        for want, want_port in items
    )


def find_interfaces(spec: str, max_ifs: int) -> list[tuple[str, str]]:
    exclude, exact, items = _parse_list(spec)
    chosen: dict[str, str] = {}
    for name, text in running_addresses():
        if len(chosen) >= max_ifs:
            break
        if name not in chosen and _matches(name, -1, items, exact) != exclude:
            chosen[name] = text
    return list(chosen.items())


def socket_interfaces(env: Mapping[str, str], max_ifs: int) -> list[tuple[str, str]]:
    """ncclFindInterfaces: NCCL_SOCKET_IFNAME, else NCCL's automatic order."""
    wanted = env.get("NCCL_SOCKET_IFNAME", "")
    if len(wanted) > 1:
        return find_interfaces(wanted, max_ifs)
    for spec in ("ib", "^docker,lo,virbr", "docker", "lo", "virbr"):
        if found := find_interfaces(spec, max_ifs):
            return found
    return []


# --------------------------------------------------------------------------- IB devices


def ib_ports(env: Mapping[str, str]) -> list[rdma.Hca]:
    """The HCA ports NCCL's IB transport would use in this process."""
    state = rdma.read_state(rdma.state_path(dict(env)))
    if not state.kernel:
        return []
    exclude, exact, items = _parse_list(env.get("NCCL_IB_HCA", ""))
    return [
        hca
        for hca in sorted(state.hcas, key=lambda h: (h.ifindex, h.port))
        if (DEV_DIR / f"uverbs{hca.ifindex}").exists()  # libibverbs skips what it cannot open
        and rdma.port_state(hca)[0] == "ACTIVE"
        and _matches(hca.name, hca.port, items, exact) != exclude
    ]


def can_pin(need: int = PINNED_NEED) -> bool:
    """Whether the kernel lets this process pin ``need`` bytes for the HCAs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return True
    try:
        status = Path("/proc/self/status").read_text()
        cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff"))
        return bool(int(cap_eff, 16) >> CAP_IPC_LOCK & 1)
    except (OSError, StopIteration, ValueError):
        return False


# --------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class Comm:
    """One communicator as this rank takes part in it."""

    rank: int
    node_ips: Sequence[str]  # per rank: the node it runs on
    comm_id: int
    dev: int = 0

    @property
    def world(self) -> int:
        return len(self.node_ips)


def init_rank(comm: Comm, env: Mapping[str, str], write: Callable[[str], None] = print) -> str:
    """Initialize NCCL for one rank, logging as NCCL does; returns the network (IB, Socket).
    Raises NcclError where NCCL fails."""
    log = Log(env, comm.dev, write)
    log.info(INIT, "ENV/Plugin: Could not find: libnccl-env.so")
    if comm.rank == 0:  # ncclGetUniqueId sets up the bootstrap network before anything else
        oob = _bootstrap(log, env)
        log.info(INIT, f"cudaDriverVersion {CUDA_DRIVER}")
    else:
        log.info(INIT, f"cudaDriverVersion {CUDA_DRIVER}")
        oob = _bootstrap(log, env)
    log.version()
    log.info(INIT | NET, "NET/Plugin: Could not find: libnccl-net.so")
    ports = _ib(log, env, oob)
    network = "IB" if ports else "Socket"
    if not ports:
        _socket(log, env)
    log.info(INIT | NET, f"Initialized NET plugin {network}")
    log.info(INIT | NET, f"Assigned NET plugin {network} to comm")
    log.info(INIT, f"Using network {network}")
    _init_comm(log, comm)
    if ports and not can_pin():
        _pin_failure(log)
    _connect(log, comm, network, max(len(ports), 1))
    return network


def _bootstrap(log: Log, env: Mapping[str, str]) -> tuple[str, str]:
    wanted = env.get("NCCL_SOCKET_IFNAME", "")
    if len(wanted) > 1:
        log.info(ENV, f"NCCL_SOCKET_IFNAME set by environment to {wanted}")
        log.info(NET, f"NCCL_SOCKET_IFNAME set to {wanted}")
    found = socket_interfaces(env, 1)
    if not found:
        last = "Bootstrap : no socket interface found"
        log.warn("bootstrap.cc:114", last)
        log.info(ALL, "init.cc:126 -> 5")
        log.info(ALL, "init.cc:160 -> 5")
        raise NcclError(INVALID_USAGE.format(v=VERSION_NUMBER, last=last))
    log.info(BOOTSTRAP, f"Bootstrap: Using {found[0][0]}:{found[0][1]}")
    return found[0]


def _ib(log: Log, env: Mapping[str, str], oob: tuple[str, str]) -> list[rdma.Hca]:
    if env.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
        log.info(ALL, "transport/net_ib.cc:852 -> 3")
        log.info(INIT | NET, "Failed to initialize NET plugin IB")
        return []
    if "NCCL_IB_HCA" in env:
        log.info(NET | ENV, f"NCCL_IB_HCA set to {env['NCCL_IB_HCA']}")
    ports = ib_ports(env)
    for index, hca in enumerate(ports):
        context = random.randrange(0x55D000000000, 0x55DFFFFFFFFF)
        log.info(
            NET,
            f"NET/IB: [{index}] {hca.name}:uverbs{hca.ifindex}:{hca.port}/RoCE provider=Mlx5 "
            f"speed=200000 context=0x{context:x} pciPath={_pci_path(hca)} ar=0",
        )
    if not ports:
        log.info(INIT | NET, "NET/IB : No device found.")
    listed = "".join(f" [{i}]{h.name}:{h.port}/RoCE" for i, h in enumerate(ports))
    log.info(INIT | NET, f"NET/IB : Using{listed} [RO]; OOB {oob[0]}:{oob[1]}")
    if not ports:
        log.info(INIT | NET, "Failed to initialize NET plugin IB")
    return ports


def _pci_path(hca: rdma.Hca) -> str:
    domain = hca.pci.split(":")[0] if hca.pci else "0000"
    return f"/sys/devices/pci{domain}:00/{domain}:00:00.0/{hca.pci or domain + ':01:00.0'}"


def _socket(log: Log, env: Mapping[str, str]) -> None:
    found = socket_interfaces(env, MAX_IFS)
    listed = "".join(f" [{i}]{name}:{text}" for i, (name, text) in enumerate(found))
    log.info(INIT | NET, f"NET/Socket : Using{listed}")


def _init_comm(log: Log, comm: Comm) -> None:
    pointer = random.randrange(0x2000000, 0x3FFFFFFF)
    head = (
        f"ncclCommInitRankConfig comm 0x{pointer:x} rank {comm.rank} nranks {comm.world} "
        f"cudaDev {comm.dev} nvmlDev {comm.dev} busId {0x60 + 0x10 * comm.dev:x} "
        f"commId 0x{comm.comm_id:x}"
    )
    log.info(INIT, f"{head} - Init START")
    nodes = list(dict.fromkeys(comm.node_ips))
    mine = comm.node_ips[comm.rank]
    local = [r for r, ip in enumerate(comm.node_ips) if ip == mine]
    log.info(
        INIT,
        f"comm 0x{pointer:x} rank {comm.rank} nRanks {comm.world} nNodes {len(nodes)} "
        f"localRanks {len(local)} localRank {local.index(comm.rank)} MNNVL 0",
    )
    if comm.rank == 0:
        ring = " ".join(str(r) for r in range(comm.world))
        for channel in range(2):
            log.info(INIT, f"Channel {channel:02d}/02 : {ring}")
    log.info(INIT, f"{head} - Init COMPLETE")


def _connect(log: Log, comm: Comm, network: str, devices: int) -> None:
    """The ring's connections of this rank: P2P on its node, the network to other nodes."""
    before = (comm.rank - 1) % comm.world
    after = (comm.rank + 1) % comm.world
    for channel in range(2):
        device = channel % devices if network == "IB" else 0
        for peer, pair, way in (
            (before, f"{before}[0] -> {comm.rank}[{comm.dev}]", "receive"),
            (after, f"{comm.rank}[{comm.dev}] -> {after}[0]", "send"),
        ):
            if comm.node_ips[peer] == comm.node_ips[comm.rank]:
                log.info(INIT | P2P, f"Channel {channel:02d}/0 : {pair} via P2P/CUMEM")
            else:
                via = f"NET/{network}/{device}"
                log.info(INIT | NET, f"Channel {channel:02d}/0 : {pair} [{way}] via {via}")
    log.info(INIT, "Connected all rings, use ring PXN 0 GDR 0")


def _pin_failure(log: Log) -> None:
    """ibv_reg_mr refused by the kernel, in the proxy thread that registers the buffers."""
    last = "Call to ibv_reg_mr_iova2 failed with error Cannot allocate memory"

    def proxy() -> None:
        log.warn("misc/ibvwrap.cc:194", last)
        for where in (
            "transport/net_ib.cc:1966",
            "transport/net_ib.cc:2010",
            "transport/net.cc:959",
        ):
            log.info(ALL, f"{where} -> 2")

    thread = threading.Thread(target=proxy, name="NCCL Proxy")
    thread.start()
    thread.join()
    raise NcclError(SYSTEM_ERROR.format(v=VERSION_NUMBER, last=last))
