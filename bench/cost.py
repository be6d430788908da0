"""What the product itself costs per step, which the bed does not distort: the round trips to
the nodes on the step's critical path, the controller's CPU seconds, and how busy the machine
was meanwhile (so that a reader sees which seconds are the bed's).

Flows run in the benchmark's process, so the meter watches the doors every node call goes
through: a command (`Runner.run`, one `ssh` exec; `run_all` batches are one), a Docker API
request over the node's SSH connection (plus the channel each pooled connection opens), and an
HTTP request to the engine's API.
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes import docker as node_docker
from vllm_redeploy.nodes.access import runner_for
from vllm_redeploy.nodes.docker import ContainerExecRunner, docker_client_for
from vllm_redeploy.nodes.runner import Runner

SAMPLE_S = 0.1
SSH_KINDS = ("exec", "channel")  # a round trip over SSH; "docker" and "http" are requests


@dataclass(frozen=True)
class Call:
    """One round trip to a node: ``kind`` is "exec", "docker", "channel" or "http"."""

    node: str
    kind: str
    start: float  # unix seconds
    end: float


def critical_chain(calls: Sequence[Call]) -> list[Call]:
    """The longest chain of calls each starting after the previous one ended: the round trips
    that waited for each other. Calls fanned out to the nodes at once overlap and count once;
    the greedy pick of the earliest end finds the longest such chain."""
    chain: list[Call] = []
    for call in sorted(calls, key=lambda c: c.end):
        if not chain or call.start >= chain[-1].end:
            chain.append(call)
    return chain


def critical_path(calls: Sequence[Call]) -> int:
    return len(critical_chain(calls))


@dataclass(frozen=True)
class Sample:
    t: float  # unix seconds
    cpu_s: float  # this process's CPU seconds (every thread) so far
    busy: int  # the machine's busy jiffies so far (every core)
    total: int


def _machine() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _sample() -> Sample:
    busy, total = _machine()
    return Sample(time.time(), time.process_time(), busy, total)


@dataclass
class StepCost:
    seconds: float
    calls: int
    critical: int
    critical_ssh: int  # of those, over SSH (SSH_KINDS; the rest are Docker and HTTP requests)
    per_node_max: int  # the most calls any one node answered
    cpu_s: float  # the controller's CPU seconds
    busy: float | None  # the machine's busy share (0-1), every core


def median_cost(costs: Sequence[StepCost]) -> StepCost:
    busy = [c.busy for c in costs if c.busy is not None]
    return StepCost(
        seconds=statistics.median(c.seconds for c in costs),
        calls=round(statistics.median(c.calls for c in costs)),
        critical=round(statistics.median(c.critical for c in costs)),
        critical_ssh=round(statistics.median(c.critical_ssh for c in costs)),
        per_node_max=round(statistics.median(c.per_node_max for c in costs)),
        cpu_s=statistics.median(c.cpu_s for c in costs),
        busy=statistics.median(busy) if busy else None,
    )


@dataclass
class Meter:
    """Records every node call and samples CPU until stopped (a context manager)."""

    calls: list[Call] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def record(self, node: str, kind: str, start: float) -> None:
        with self._lock:
            self.calls.append(Call(node, kind, start, time.time()))

    def _sampling(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append(_sample())

    def _at(self, t: float) -> Sample | None:
        """The counters at ``t``, read between the samples around it (None outside them)."""
        i = bisect.bisect_right(self.samples, t, key=lambda s: s.t)
        if i == 0 or i == len(self.samples):
            return self.samples[-1] if i and self.samples[-1].t == t else None
        a, b = self.samples[i - 1], self.samples[i]
        share = (t - a.t) / (b.t - a.t) if b.t > a.t else 0.0

        def between(x: float, y: float) -> float:
            return x + share * (y - x)

        return Sample(
            t,
            between(a.cpu_s, b.cpu_s),
            round(between(a.busy, b.busy)),
            round(between(a.total, b.total)),
        )

    def cost(self, start: float, end: float, slack: float = 0.0) -> StepCost:
        """What the span from ``start`` to ``end`` cost; a call up to ``slack`` outside it
        counts (the span's marks are taken around the work, not at its first byte)."""
        inside = [c for c in self.calls if c.start >= start - slack and c.end <= end + slack]
        per_node: dict[str, int] = {}
        for call in inside:
            per_node[call.node] = per_node.get(call.node, 0) + 1
        first, last = self._at(start), self._at(end)
        cpu, busy = 0.0, None
        if first is not None and last is not None and last.total > first.total:
            cpu = last.cpu_s - first.cpu_s
            busy = min((last.busy - first.busy) / (last.total - first.total), 1.0)
        chain = critical_chain(inside)
        return StepCost(
            end - start,
            len(inside),
            len(chain),
            sum(1 for c in chain if c.kind in SSH_KINDS),
            max(per_node.values(), default=0),
            cpu,
            busy,
        )


# (the instance, the call's arguments) -> the node; None: not a node call of its own.
NodeOf = Callable[[Any, tuple[Any, ...], dict[str, Any]], str | None]


def _wrap(owner: type, name: str, node_of: NodeOf, kind: str, meter: Meter) -> Any:
    original = getattr(owner, name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            return original(self, *args, **kwargs)
        finally:
            if (node := node_of(self, args, kwargs)) is not None:
                meter.record(node, kind, started)

    setattr(owner, name, counted)
    return original


@contextlib.contextmanager
def metered(prefect_api: str | None = None) -> Iterator[Meter]:
    """Count every node call this process makes, and sample CPU, while inside. Requests to
    ``prefect_api`` are Prefect's bookkeeping, not node calls."""
    meter = Meter()

    def engine_host(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        request = args[0] if args else kwargs["request"]  # httpx.Client.send(request, ...)
        url = str(request.url)
        return None if prefect_api and url.startswith(prefect_api) else str(request.url.host)

    doors: list[tuple[type, str, NodeOf, str]] = [
        # A command inside a container is Docker API requests, counted as such.
        (
            Runner,
            "run",
            lambda r, *_: None if isinstance(r, ContainerExecRunner) else r.node,
            "exec",
        ),
        (node_docker._RunnerSSHAdapter, "send", lambda a, *_: a._runner.node, "docker"),
        (node_docker._LeasedConnection, "connect", lambda c, *_: c._runner.node, "channel"),
        (httpx.Client, "send", engine_host, "http"),  # the engine's API: /health, the probe
    ]
    originals = [
        (owner, name, _wrap(owner, name, of, kind, meter)) for owner, name, of, kind in doors
    ]
    meter.samples.append(_sample())
    sampler = threading.Thread(target=meter._sampling, daemon=True)
    sampler.start()
    try:
        yield meter
    finally:
        meter._stop.set()
        sampler.join()
        meter.samples.append(_sample())
        for owner, name, original in originals:
            setattr(owner, name, original)


@dataclass(frozen=True)
class Floors:
    """What a step cannot go below on this bed, measured by hand on its first node."""

    round_trip_s: float  # `true` over an open SSH connection, as the product runs commands
    docker_call_s: float  # one Docker API request (`GET /_ping`) over that connection
    docker_run_s: float  # `docker run --rm --entrypoint /bin/sh IMAGE -c :` on the node's engine


def _median_s(fn: Callable[[], object], tries: int) -> float:
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def floors(config_path: Path, bed: TestBed, tries: int = 5) -> Floors:
    config = load_config(config_path, env_file=None)
    runner = runner_for(config.nodes[0], config)
    client = docker_client_for(runner)
    try:
        runner.check_connection()  # connects
        client.ping()  # opens the pooled channel
        round_trip = _median_s(runner.check_connection, tries)
        docker_call = _median_s(client.ping, tries)
    finally:
        client.close()
        runner.close()
    with contextlib.closing(bed.nodes[0].engine.client()) as local:
        # The same image with the configured mounts (the bed's images need theirs).
        image, volumes = config.vllm.image, list(config.vllm.volumes)

        def run() -> None:
            local.containers.run(
                image, entrypoint=["/bin/sh", "-c", ":"], volumes=volumes, remove=True
            )

        docker_run = _median_s(run, tries)
    return Floors(round_trip, docker_call, docker_run)
