"""Which transport did NCCL choose? Read from its INFO log (``NCCL_DEBUG=INFO``).

NCCL writes its debug lines to each process's stdout, so they land in the vLLM engine
container's log. The shapes follow real captures (``tests/fixtures/nccl``, NCCL 2.28.9) and the
project brief's RDMA lines. Every NCCL line carries the prefix ``host:pid:tid [cudaDev]`` (the
tid and cudaDev vary within a process: proxy threads); WARN lines add a timestamp before it and
the source position after it (the last example is cut short here: its message is
``Bootstrap : no socket interface found``)::

    vm:681:681 [0] NCCL INFO NET/IB : No device found.
    vm:681:681 [0] NCCL INFO NET/IB : Using [RO]; OOB eth0:192.0.2.2<0>
    vm:681:681 [0] NCCL INFO NET/Socket : Using [0]eth0:192.0.2.2<0>
    vm:681:681 [0] NCCL INFO Using network Socket
    vm:681:681 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0
    vm:851:851 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
    [2026-11-30 10:18:57] vm:770:770 [0] bootstrap.cc:114 NCCL WARN Bootstrap : no socket ...

Without HCAs the IB transport still prints its ``Using`` line, with no device in it, then says
``Failed to initialize NET plugin IB``.

With RDMA NICs (RoCE here; ``/IB`` or ``/IB/SHARP`` on InfiniBand) the IB transport lists its
HCAs as ``[index]name:port/link`` and the out-of-band (bootstrap) interface (shown here without
the ``host:pid:tid [cudaDev] NCCL INFO`` prefix)::

  NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; OOB enp1s0f1np1:192.168.200.12<0>
  Using network IB
  Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0

NVIDIA's IB plugin (``libnccl-net.so`` from HPC-X) names itself ``IBext`` or ``IBext_v8`` and up:
``Using network IBext_v8``, ``via NET/IBext_v8/0/GDRDMA``; those count as IB.

In a vLLM-with-Ray log the workers' lines come through Ray, prefixed with the actor and its node
(often in ANSI colours)::

    (RayWorkerWrapper pid=1234, ip=192.168.200.13) node2:1234:1234 [0] NCCL INFO Using network IB

Ray may fold identical lines into one with `` [repeated 3x across cluster]``; vLLM's own worker
processes prefix theirs like ``(Worker_TP1 pid=5678)``.

The judgement rests on ``Using network NAME`` alone, printed once per communicator by each
process: IB in every process that printed one is ``rdma``, Socket in every one is ``socket``,
both is ``mixed``; no such line (a failed bootstrap, a log cut short, NCCL_DEBUG unset) is
``unknown``, and so is another plugin's network (e.g. AWS's Libfabric), which this parser does not
judge. NCCL prints the line even when a single host's ranks talk over P2P/NVLink only (the
channels say ``via P2P/...``): it is the network NCCL would use between hosts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Transport = Literal["rdma", "socket", "mixed", "unknown"]

# ESC [ ... final byte (CSI), and SGR colour codes whose ESC got lost on the way ("[36m").
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|\[\d{1,3}(?:;\d{1,3})*m")
# host:pid:tid [cudaDev] (file.cc:line )NCCL LEVEL  - bounded so that no input is slow.
# "host:pid:tid [dev] NCCL INFO ...", the prefix NCCL writes; lines quoted without it (docs,
# issues, an operator's paste) count as one process.
_NCCL = re.compile(
    r"(?:(?<![\w.-])(?P<host>[\w.-]{1,255}):(?P<pid>\d{1,10}):\d{1,10} \[-?\d{1,5}\]"
    r"(?: [\w./-]{1,200}:\d{1,10})? |(?<![\w.-]))NCCL (?P<level>INFO|WARN|ABORT|TRACE) ?"
)
# "(RayWorkerWrapper pid=1234, ip=192.168.200.13)", "(Worker_TP1 pid=5678)".
_PROCESS = re.compile(r"\([\w.-]{1,100}((?:,? {1,3}\w{1,30}=[^\s,()]{0,100}){1,10})\)")
_ATTR = re.compile(r"(\w{1,30})=([^\s,()]{0,100})")
_REPEATED = re.compile(r"\s*\[repeated \d{1,10}x across cluster\]\s*$")

_NETWORK = re.compile(r"Using network (\S.{0,99})$")
_NET_IB = re.compile(r"NET/(IB\w{0,20}) ?: ?Using\b([^;]{0,4000})(?:; ?OOB ([^\s:<]{1,64}))?")
_NET_SOCKET = re.compile(r"NET/Socket ?: ?Using\b(.{0,4000})")
_BOOTSTRAP = re.compile(r"Bootstrap ?: ?Using ([^\s:<]{1,64})")
_DEVICE = re.compile(r"\[\d{1,4}\]([^\s\[\];/]{1,100})")
_CHANNEL = re.compile(r"Channel \d{1,4}/\d{1,4} : .{0,200}? via (\S{1,100})")
_VERSION = re.compile(r"NCCL version (\S{1,50})")
# INFO lines worth reporting beside every WARN line: why IB was not taken.
_NOTABLE = re.compile(r"NET/IB ?: ?No device found|Failed to initialize NET plugin \S{1,50}")


@dataclass(frozen=True)
class RankTransport:
    """What one process (one rank's worker) logged about its NCCL network.

    ``host`` and ``pid`` come from NCCL's own prefix, ``ip`` from a Ray prefix when there is one.
    """

    host: str
    pid: int
    ip: str | None = None
    networks: tuple[str, ...] = ()  # each "Using network NAME", as logged: ("IBext_v8",)
    hcas: tuple[str, ...] = ()  # "rocep1s0f1:1", from "NET/IB : Using [0]rocep1s0f1:1/RoCE"
    interfaces: tuple[str, ...] = ()  # OOB, socket and bootstrap interfaces: ("eth0",)
    channels: tuple[str, ...] = ()  # each "via ..." of the channel lines: ("NET/Socket/0",)
    warnings: tuple[str, ...] = ()  # WARN lines, "NET/IB : No device found", failed plugins
    nccl_version: str | None = None  # "2.28.9+cuda13.0"

    @property
    def identity(self) -> str:
        """``192.168.200.13/node2:1234`` with a Ray prefix, else ``node2:1234``."""
        where = f"{self.host}:{self.pid}" if self.host else "(no process prefix)"
        return f"{self.ip}/{where}" if self.ip else where

    @property
    def uses_network(self) -> bool:
        """Whether any channel went through the network (``via NET/...``), not P2P or SHM."""
        return any(channel.startswith("NET/") for channel in self.channels)

    @property
    def network(self) -> str | None:
        """``IB``, ``Socket`` or another plugin's name, of the first ``Using network`` line."""
        return _family(self.networks[0]) if self.networks else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "host": self.host,
            "pid": self.pid,
            "ip": self.ip,
            "network": self.network,
            "networks": list(self.networks),
            "hcas": list(self.hcas),
            "interfaces": list(self.interfaces),
            "channels": list(self.channels),
            "uses_network": self.uses_network,
            "warnings": list(self.warnings),
            "nccl_version": self.nccl_version,
        }


@dataclass(frozen=True)
class NcclTransport:
    """The judgement over all processes in a log, with each one's evidence."""

    transport: Transport
    hcas: tuple[str, ...] = ()  # every HCA NCCL listed, any process, first seen first
    ranks: tuple[RankTransport, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "transport": self.transport,
            "hcas": list(self.hcas),
            "ranks": [rank.as_dict() for rank in self.ranks],
        }


def judge_transport(text: str) -> NcclTransport:
    """Judge which transport NCCL chose from a log excerpt; never raises, ignores other text."""
    ranks: dict[tuple[str | None, str, int], _Rank] = {}
    for key, level, message in nccl_lines(text):
        rank = ranks.setdefault(key, _Rank())
        rank.read(level, message)
    found = tuple(rank.freeze(*key) for key, rank in ranks.items())
    hcas = _unique(hca for rank in found for hca in rank.hcas)
    return NcclTransport(_judge(found), hcas, found)


def nccl_lines(text: str) -> Iterator[tuple[tuple[str | None, str, int], str, str]]:
    """Yield ((ray ip, host, pid), level, message) for each NCCL line, colours stripped.

    Two processes writing at once can glue their lines together: each NCCL prefix starts a new
    message, so a glued line yields both.
    """
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        matches = list(_NCCL.finditer(line))
        if not matches:
            continue
        ip = _ray_ip(line[: matches[0].start()])
        for match, after in zip(matches, [*matches[1:], None], strict=True):
            end = after.start() if after else len(line)
            message = _REPEATED.sub("", line[match.end() : end]).strip()
            host, pid = match["host"] or "", int(match["pid"] or 0)
            yield (ip, host, pid), match["level"], message


@dataclass
class _Rank:
    """Mutable collector for one process, frozen into a RankTransport."""

    networks: list[str] = field(default_factory=list)
    hcas: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    channels: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    version: str | None = None

    def read(self, level: str, message: str) -> None:
        if level in ("WARN", "ABORT"):
            _add(self.warnings, _clean(message))
            return
        if match := _NETWORK.match(message):
            _add(self.networks, match[1].strip())
        elif match := _NET_IB.match(message):
            for device in _DEVICE.findall(match[2]):
                _add(self.hcas, device)
            if match[3]:
                _add(self.interfaces, match[3])
        elif match := _NET_SOCKET.match(message):
            for device in _DEVICE.findall(match[1]):
                _add(self.interfaces, device.split(":")[0])
        elif match := _BOOTSTRAP.match(message):
            _add(self.interfaces, match[1])
        elif match := _CHANNEL.match(message):
            _add(self.channels, match[1])
        elif match := _VERSION.match(message):
            self.version = self.version or match[1]
        elif match := _NOTABLE.match(message):
            _add(self.warnings, _clean(match[0]))

    def freeze(self, ip: str | None, host: str, pid: int) -> RankTransport:
        return RankTransport(
            host=host,
            pid=pid,
            ip=ip,
            networks=tuple(self.networks),
            hcas=tuple(self.hcas),
            interfaces=tuple(self.interfaces),
            channels=tuple(self.channels),
            warnings=tuple(self.warnings),
            nccl_version=self.version,
        )


def _judge(ranks: tuple[RankTransport, ...]) -> Transport:
    families = {_family(name) for rank in ranks for name in rank.networks}
    if families == {"IB"}:
        return "rdma"
    if families == {"Socket"}:
        return "socket"
    if families == {"IB", "Socket"}:
        return "mixed"
    return "unknown"  # no "Using network" line, or a network this parser does not judge


def _family(name: str) -> str:
    """``IB`` for NCCL's IB transport and NVIDIA's plugin (``IBext``, ``IBext_v8``)."""
    if re.fullmatch(r"IB(?:ext\w*)?", name):
        return "IB"
    return name


def _ray_ip(prefix: str) -> str | None:
    """The ``ip=`` of the last ``(Actor pid=…, ip=…)`` group before the NCCL prefix."""
    ip = None
    for group in _PROCESS.finditer(prefix):
        attrs = dict(_ATTR.findall(group[1]))
        ip = attrs.get("ip") or ip
    return ip


def _clean(message: str) -> str:
    return " ".join(message.split()).rstrip(".")


def _add(items: list[str], item: str) -> None:
    if item and item not in items:
        items.append(item)


def _unique(items: Iterator[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
