"""One flow run on the test bed, measured: a redeploy, an engine crash during load, an ensure.

Flows run in this process against the benchmark's Prefect server; the stand-in's own clock marks
(VRD_EVENT_LOG: "listening", "crashed") and the engine container's log timestamps say when the
emulated vLLM did what, so the flow's lags can be read against them.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.flowruns import FlowRunRecord, read_flow_run
from flows.redeploy import redeploy_vllm_cluster
from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config
from vllm_redeploy.launch import engine_container, plan_for

LOAD_START_LINE = "Starting to load model"
RAY_STARTED_LINE = "Ray runtime started."  # what `ray start` prints once its node registered
READY_STEP = "wait-ready"


@dataclass
class FlowRun:
    """A flow run as the caller saw it (wall clock) and as the server recorded it."""

    config: Path
    env: dict[str, str]
    started: float  # time.time() just before the call
    wall_s: float
    record: FlowRunRecord
    events: dict[str, float] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)  # "started", "loading" (unix s)
    ray: dict[str, float] = field(default_factory=dict)  # ray_marks(), on the Ray backend

    def step_end(self, step: str) -> float | None:
        ends = [t.end for t in self.record.tasks if t.step == step]
        return max(ends) if ends else None


@dataclass(frozen=True)
class Redeploy:
    run: FlowRun
    load_s: float

    @property
    def overhead_s(self) -> float:
        return self.run.wall_s - self.load_s

    @property
    def ready_lag_s(self) -> float | None:
        ready, served = self.run.step_end(READY_STEP), self.run.events.get("listening")
        return ready - served if ready and served else None


@dataclass(frozen=True)
class Crash:
    run: FlowRun

    @property
    def crashed(self) -> float:
        return self.run.events["crashed"]

    @property
    def failed_lag_s(self) -> float | None:
        """From the engine's death to the flow run's Failed state (server's timestamp)."""
        if self.run.record.state != "FAILED" or self.run.record.state_time is None:
            return None
        return self.run.record.state_time - self.crashed

    @property
    def noticed_lag_s(self) -> float | None:
        """From the engine's death to the wait step failing (before diagnostics and teardown)."""
        ended = self.run.step_end(READY_STEP)
        return ended - self.crashed if ended else None


@dataclass(frozen=True)
class Ensure:
    run: FlowRun
    restarts: int
    action: str

    @property
    def wall_s(self) -> float:
        return self.run.wall_s


def read_events(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    return {e["event"]: e["t"] for e in map(json.loads, filter(None, lines))}


def docker_time(text: str) -> float:
    """Docker's RFC 3339 timestamps carry nanoseconds; Python parses microseconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac or '0')[:6]:0<6}").replace(tzinfo=UTC).timestamp()


def engine_marks(bed: TestBed, config: Path) -> dict[str, float]:
    """When the head's engine container started and when it began loading weights."""
    name = engine_container(load_config(config, env_file=None))
    with contextlib.closing(bed.nodes[0].engine.client()) as client:
        try:
            container = client.containers.get(name)
        except Exception:  # gone (torn down after a failure)
            return {}
        marks = {"started": docker_time(container.attrs["State"]["StartedAt"])}
        for line in container.logs(timestamps=True).decode(errors="replace").splitlines():
            stamp, _, text = line.partition(" ")
            if LOAD_START_LINE in text:
                marks["loading"] = docker_time(stamp)
                break
    return marks


def ray_marks(bed: TestBed, config: Path) -> dict[str, float]:
    """Ray's own start, the floor of the Ray steps: on each node, its Ray container's start to
    Ray's success line (printed once the node is registered with the head), by the container's
    log timestamps. ``slowest_s``: the slowest node's; ``all_s``: the head container's start to
    the last node registered. Empty when the run did not start Ray."""
    plan = plan_for("ray", load_config(config, env_file=None))  # its container names
    names = {m.node: m.spec.name for m in plan.members if m is not plan.api}
    started, registered = [], []
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            name = names.get(node.name)
            found = name and client.containers.list(all=True, filters={"name": f"^{name}$"})
            if not found:  # not a node of this cluster, or not on this backend
                continue
            container = found[0]
            logs = container.logs(timestamps=True).decode(errors="replace").splitlines()
            stamps = [line.partition(" ")[0] for line in logs if RAY_STARTED_LINE in line]
            if stamps:
                started.append(docker_time(container.attrs["State"]["StartedAt"]))
                registered.append(docker_time(stamps[0]))
    if not started:
        return {}
    slowest = max(r - s for s, r in zip(started, registered, strict=True))
    return {"slowest_s": slowest, "all_s": max(registered) - min(started)}


def run_flow(api_url: str, bed: TestBed, config: Path, env: dict[str, str], mode: str) -> FlowRun:
    started = time.time()
    state = redeploy_vllm_cluster(str(config), mode, return_state=True)
    wall = time.time() - started
    record = read_flow_run(api_url, str(state.state_details.flow_run_id))
    return FlowRun(config, env, started, wall, record)


def stand_in_env(bed: TestBed, tag: str, load_s: float, fault: str = "") -> dict[str, str]:
    env = {
        "VRD_LOAD_SECONDS": f"{load_s:g}",
        "VRD_EVENT_LOG": str(bed.observed / f"{tag}.events.jsonl"),
    }
    if fault:
        env["VRD_FAULT"] = fault
    return env


def write_config(bed: TestBed, tag: str, env: dict[str, str], **changes: Any) -> Path:
    vllm = {"env": env, **changes.pop("vllm", {})}
    return bed.write_config(bed.root / f"{tag}.toml", vllm=vllm, **changes)


def redeploy(api_url: str, bed: TestBed, tag: str, load_s: float, backend: str = "ray") -> Redeploy:
    """A redeploy with the stand-in loading for ``load_s``; ``backend`` as [vllm] backend (Ray
    by name: auto takes mp on the bed's image, whose vLLM has --nnodes)."""
    env = stand_in_env(bed, tag, load_s)
    config = write_config(bed, tag, env, vllm={"backend": backend})
    run = run_flow(api_url, bed, config, env, "redeploy")
    if run.record.state != "COMPLETED":
        raise RuntimeError(f"the redeploy {tag} ended {run.record.state}; see the Prefect UI")
    run.events = read_events(Path(env["VRD_EVENT_LOG"]))
    if "listening" not in run.events:
        raise RuntimeError(
            f"the redeploy {tag} left no 'listening' mark in {env['VRD_EVENT_LOG']}: the "
            "readiness lag cannot be measured (is that directory mounted into the containers?)"
        )
    run.engine = engine_marks(bed, run.config)
    run.ray = ray_marks(bed, run.config)
    return Redeploy(run, load_s)


def crash(api_url: str, bed: TestBed, tag: str, load_s: float) -> Crash:
    env = stand_in_env(bed, tag, load_s, fault="crash_during_load")
    config = write_config(bed, tag, env, vllm={"backend": "ray"})  # as the earlier results
    run = run_flow(api_url, bed, config, env, "redeploy")
    run.events = read_events(Path(env["VRD_EVENT_LOG"]))
    if run.record.state != "FAILED" or "crashed" not in run.events:
        raise RuntimeError(f"the crash run {tag} ended {run.record.state}, events {run.events}")
    return Crash(run)


Snapshot = dict[tuple[str, str], tuple[str, str]]


def containers(bed: TestBed) -> Snapshot:
    """Every container on every node: (node, name) -> (ID, StartedAt)."""
    found: Snapshot = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True):
                found[(node.name, c.name)] = (c.id, c.attrs["State"]["StartedAt"])
    return found


def restarted(before: Snapshot, after: Snapshot) -> int:
    """Containers created, removed, recreated or restarted between two snapshots."""
    return sum(1 for key in before.keys() | after.keys() if before.get(key) != after.get(key))


def ensure(api_url: str, bed: TestBed, after: Redeploy) -> Ensure:
    """`ensure` with the same configuration as the redeploy that just succeeded."""
    before = containers(bed)
    started = time.time()
    state = redeploy_vllm_cluster(str(after.run.config), "ensure", return_state=True)
    wall = time.time() - started
    if not state.is_completed():
        raise RuntimeError(f"ensure on a healthy cluster ended {state.type}")
    changed = restarted(before, containers(bed))
    record = read_flow_run(api_url, str(state.state_details.flow_run_id))
    run = FlowRun(after.run.config, after.run.env, started, wall, record)
    return Ensure(run, changed, str(state.result().get("action", "")))
