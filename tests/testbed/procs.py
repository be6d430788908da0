"""Small helpers to start daemons and wait for them, with teardown that cannot hang."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if check():
                return
        time.sleep(0.05)
    tail = ""
    if log is not None and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise TimeoutError(f"{what} not ready after {timeout:g} s{tail}")


# Ports for the servers tests start: below Linux's ephemeral range (32768-60999), so an outgoing
# connection (Ray, Prefect and docker clients open hundreds) cannot take one between the pick and
# the server's bind; above Ray's worker ports (10002-19999); below the bed's API port (30000).
TEST_PORTS = range(21000, 30000)
_handed_out: set[tuple[str, int]] = set()


def _my_ports() -> range:
    """pytest-xdist's workers pick from their own slice: a port one of them picked but has not
    bound yet is never another's pick."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker[2:].isdigit() or count <= 1:
        return TEST_PORTS
    size = len(TEST_PORTS) // count
    start = TEST_PORTS.start + int(worker[2:]) * size
    return range(start, start + size)


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` (or on all addresses), not handed out before."""
    rng = random.Random()
    ports = _my_ports()
    for _ in range(1000):
        port = rng.choice(ports)
        if (host, port) in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add((host, port))
        return port
    raise RuntimeError(f"no free port on {host} in {TEST_PORTS}")


OWNER_FILE = "owner.pid"


def claim(directory: Path) -> None:
    """Mark ``directory`` as this process's: a later session sweeps it once this one is gone."""
    (directory / OWNER_FILE).write_text(f"{os.getpid()}\n")


def sweep_abandoned(pattern: str = "/tmp/vrd-*") -> list[Path]:
    """Remove what killed test sessions left behind: for each claimed directory whose owner is
    gone, every process that names it (daemons run in their own sessions and outlive pytest),
    the mounts below it, and the directory. Directories nobody claimed (a bed an operator
    brought up with `python -m tests.testbed up`) are left alone."""
    swept = []
    for directory in sorted(Path(pattern).parent.glob(Path(pattern).name)):
        owner = directory / OWNER_FILE
        try:
            pid = int(owner.read_text().strip())
        except (OSError, ValueError):
            continue
        if alive(pid):
            continue
        for victim in pids_with_arg(str(directory)) + pids_with_env(str(directory)):
            kill_tree(victim, grace=0)
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):
            point = line.split()[1]
            if point.startswith(f"{directory}/"):
                subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)
        swept.append(directory)
    return swept


def pids_with_env(fragment: str) -> list[int]:
    """Processes with ``fragment`` in their environment (a server told its home by variable)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                if fragment.encode() in f.read():
                    found.append(int(entry))
    return found


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a daemon in its own session, so it outlives a CLI that started it."""
    with log.open("ab") as f:
        return subprocess.Popen(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found, by /proc ppid)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pids_with_arg(fragment: str) -> list[int]:
    """Processes whose command line contains ``fragment``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if fragment.encode() in f.read():
                    found.append(int(entry))
    return found


def kill_tree(pid: int, grace: float = 10.0) -> None:
    """SIGTERM ``pid``, wait up to ``grace`` s, then SIGKILL it and anything left below it."""
    tree = descendants(pid)  # before the parent goes: orphans are reparented and lost
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for victim in [pid, *tree, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; never raises."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def freeze_container(container: Any) -> list[int]:
    """SIGSTOP every process of a Docker container (docker SDK object), as a node that hangs
    (a kernel stall, a frozen GPU driver) leaves them: alive, holding their sockets, silent.
    Docker still calls the container running. Returns the host PIDs stopped."""
    top = container.top(ps_args="-eo pid")
    pids = [int(row[0]) for row in top["Processes"]]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    return pids


def kill_in_container(container: Any, fragment: str) -> int:
    """SIGKILL the process of a Docker container (docker SDK object) whose command line has
    ``fragment``, as the kernel's OOM killer picks one process and leaves the container up.
    Returns its host PID."""
    top = container.top(ps_args="-eo pid,args")
    found = [int(row[0]) for row in top["Processes"] if fragment in row[1]]
    if not found:
        raise LookupError(f"no {fragment!r} in {container.name}: {top['Processes']}")
    os.kill(found[0], signal.SIGKILL)
    return found[0]


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers 200 now (a server's health, while it starts)."""
    import httpx  # here: the bed's namespace holder imports this module with the system Python

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def drain_prefect_workers(timeout: float = 15) -> None:
    """Send this process's queued Prefect logs and events, then stop their workers: each is
    one per process and bound to the API it started with (the next one starts at the current
    API). Left for the exit, each batch is retried with backoff against a stopped server."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout)
