"""Who listens on a node's ports (`ss -Hltnp`), whether a bind of the group collides with it,
and who owns the process (its cgroup: a container, a systemd unit, a login's session).

Read twice in a run: in preflight, to refuse before anything stops when a listener that
stop-autostart will not take away holds a port the group must bind; in ports-free, after the
stop, to wait until the old stack has let go."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllm_redeploy.safe_text import shown

WILDCARD = ("0.0.0.0", "*", "::", "")  # noqa: S104 - comparing, not binding
# A container's processes sit in a cgroup named by its ID: `/docker/<id>` (cgroupfs driver),
# `/system.slice/docker-<id>.scope` (systemd driver, DGX OS's default).
CONTAINER_CGROUP = re.compile(r"docker[-/]([0-9a-f]{64})")
PROCESS = re.compile(r'\("([^"]*)",pid=(\d+)')
# Docker's userland proxy holds a published port (`-p 8000:8000`) for a bridged container.
DOCKER_PROXY = "docker-proxy"


def ss_argv(ports: Iterable[int]) -> list[str]:
    """`ss` listing the TCP listeners on ``ports``, with their processes where visible."""
    query = " or ".join(f"sport = :{port}" for port in ports)
    return ["ss", "-Hltnp", f"( {query} )"]


@dataclass(frozen=True)
class Listener:
    address: str  # as ss shows it, without brackets or scope: 127.0.0.1, 0.0.0.0, ::1
    port: int
    processes: tuple[tuple[str, int], ...]  # (name, PID); empty when ss hides them

    def collides(self, bind: str) -> bool:
        """Would it keep the group from binding ``bind`` on this port? A bind to every address
        fails on any listener of the port (127.0.0.1, the LAN address, ...); one to an address,
        on a listener there or on every address."""
        return bind in WILDCARD or self.address in (bind, *WILDCARD)


def owners(listeners: Iterable[Listener]) -> str:
    """', python3 (PID 7)': each process once (one may listen on IPv4 and IPv6), or '' where
    ss shows none."""
    found = dict.fromkeys(
        f"{shown(name)} (PID {pid})" for x in listeners for name, pid in x.processes
    )
    return f", {', '.join(found)}" if found else ""


def parse_ss(stdout: str) -> list[Listener]:
    """The listeners of `ss -Hltn[p]` output; lines that are not listeners are skipped."""
    found = []
    for line in stdout.split("\n"):
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        if not port.isdigit():
            continue
        address = address.strip("[]").split("%")[0]  # [::1], fe80::1%eth0
        processes = tuple((name, int(pid)) for name, pid in PROCESS.findall(line))
        found.append(Listener(address, int(port), processes))
    return found


def collisions(
    listeners: Iterable[Listener], binds: Mapping[int, str]
) -> dict[int, list[Listener]]:
    """Per port of ``binds`` (port -> where the group binds it), the listeners in its way."""
    return {
        port: [x for x in listeners if x.port == port and x.collides(bind)]
        for port, bind in binds.items()
    }


# A process that ended since ss looked, or is ending (a zombie: cgroup v1 shows it at the root of
# every hierarchy), prints no cgroup: an engine exiting at that moment is no stranger on its port.
CGROUP_ARGV_SCRIPT = (
    'for p; do echo "== $p"; grep -qs "^State:[[:space:]]*[ZX]" "/proc/$p/status" || '
    'cat "/proc/$p/cgroup" 2>/dev/null || true; done'
)


def cgroups_argv(pids: Iterable[int]) -> list[str]:
    """One command printing each process's cgroup file after a `== PID` line."""
    return ["sh", "-c", CGROUP_ARGV_SCRIPT, "sh", *(str(p) for p in sorted(set(pids)))]


def parse_cgroups(stdout: str) -> dict[int, list[str]]:
    """PID -> its cgroup paths (one per hierarchy: v2 has one, v1 one per controller); a process
    that printed none (ended, or ending) is left out: it holds no port by the time we act."""
    found: dict[int, list[str]] = {}
    pid = None
    for line in stdout.split("\n"):
        if line.startswith("== ") and line[3:].isdigit():
            pid = int(line[3:])
        elif pid is not None and line.count(":") >= 2:
            found.setdefault(pid, []).append(line.split(":", 2)[2])
    return found


@dataclass(frozen=True)
class Owner:
    """What a listening process belongs to, from its cgroup."""

    container_id: str | None = None
    unit: str | None = None  # the systemd unit or scope it runs in (session-3.scope, ...)

    @classmethod
    def of(cls, paths: Iterable[str]) -> Owner:
        paths = list(paths)
        for path in paths:
            if found := CONTAINER_CGROUP.search(path):
                return cls(container_id=found.group(1))
        # The systemd hierarchy names the unit (v2's single one, v1's name=systemd); any other
        # path names it too when the process is in a unit's own cgroup.
        units = [p.rstrip("/").rpartition("/")[2] for p in paths]
        return cls(unit=next((u for u in units if "." in u), None))


@dataclass(frozen=True)
class Kept:
    """A listener that the stop will not take away, in words for the refusal."""

    listener: Listener
    why: str  # "python3 (PID 7) in session-3.scope, which ...", ...

    def words(self, label: str) -> str:
        x = self.listener
        return f"{x.address or '*'}:{x.port} (the {label}) is held by {self.why}"


@dataclass(frozen=True)
class Stopping:
    """What stop-autostart takes away on the node."""

    containers: Mapping[str, str]  # ID -> name of each container it removes
    units: frozenset[str]


@dataclass(frozen=True)
class Others:
    """What the node says of the containers that stop-autostart leaves."""

    names: Mapping[str, str]  # container ID -> name, for the words
    published_by: Mapping[int, list[str]]  # a port -> the containers publishing it


def kept_listeners(
    found: Mapping[int, list[Listener]],
    owners: Mapping[int, Owner],
    stopping: Stopping,
    others: Others,
) -> list[Kept]:
    """The listeners in the group's way (``found``, per port) that stop-autostart leaves running.

    ``owners`` maps a PID to its cgroup's owner. A listener whose process ss hides is never
    counted (ports-free judges it after the stop), nor a container while units are stopped: a
    unit's `docker run` stops the container it started, whatever its name."""
    kept = []
    for port, listeners in found.items():
        for listener in listeners:
            for name, pid in listener.processes:
                why = _kept_why(
                    f"{shown(name)} (PID {pid})",
                    name == DOCKER_PROXY,
                    owners.get(pid),
                    port,
                    stopping,
                    others,
                )
                if why:
                    kept.append(Kept(listener, why))
    return kept


def _kept_why(
    process: str,
    proxy: bool,
    owner: Owner | None,
    port: int,
    stopping: Stopping,
    others: Others,
) -> str | None:
    if proxy:
        publishers = others.published_by.get(port, [])
        if stopping.units or set(publishers) & set(stopping.containers.values()):
            return None
        named = ", ".join(map(shown, publishers)) or "a container"
        return f"{process}, the published port of {named}, which [autostart] does not name"
    if owner is None:  # it ended since ss looked, or its cgroup could not be read
        return None
    if owner.container_id is not None:
        if owner.container_id in stopping.containers or stopping.units:
            return None
        name = others.names.get(owner.container_id, owner.container_id[:12])
        return f"{process} in container {shown(name)}, which [autostart] containers does not name"
    if owner.unit in stopping.units:
        return None
    where = f" in {shown(owner.unit)}" if owner.unit else ""
    return f"{process}{where}, which is neither a container nor a unit that [autostart] names"
