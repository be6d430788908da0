"""The benchmark's measurements, kept per node count, and the medians and targets read from them."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from bench.caches import CacheStarts
from bench.cost import Floors, Meter, StepCost, median_cost
from bench.measure import Crash, Ensure, FlowRun, Redeploy
from bench.reference import ReferenceRun

# Issue 25's targets: overhead beyond the model's own load at the smallest N, per backend, and
# the largest N over the smallest.
OVERHEAD_MAX_S = {"mp": 5.0, "ray": 10.0}
# Issue 7's targets.
BEYOND_BOOKKEEPING_MAX_S = 5.0  # overhead at the smallest N beyond Prefect's bookkeeping
SCALING_MAX = 1.25  # overhead at the largest N over overhead at the smallest
READY_LAG_MAX_S = 1.0
CRASH_LAG_MAX_S = 3.0
ENSURE_MAX_S = 3.0  # issue 38's (issue 7 asked for 5)
REFERENCE_POLL_TO_BEAT_S = 10.0
# Task run times are the client's clock marks around the task's body: a call on the edge
# belongs to the step.
SPAN_SLACK_S = 0.05

# The reference script's marks, named like the flow's steps.
REFERENCE_STEPS = {"join-workers": "join-worker", "ready": "wait-ready"}


def median(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


@dataclass
class PerNodes:
    """Everything measured on one bed of ``nodes`` nodes."""

    nodes: int
    redeploys: list[Redeploy] = field(default_factory=list)
    ensures: list[Ensure] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    bookkeeping: list[float] = field(default_factory=list)
    mp_redeploys: list[Redeploy] = field(default_factory=list)  # the same, vLLM's own launcher

    def overhead_of(self, backend: str) -> float | None:
        runs = self.mp_redeploys if backend == "mp" else self.redeploys
        return median(r.overhead_s for r in runs)

    @property
    def wall_s(self) -> float | None:
        return median(r.run.wall_s for r in self.redeploys)

    @property
    def overhead_s(self) -> float | None:
        return median(r.overhead_s for r in self.redeploys)

    @property
    def bookkeeping_s(self) -> float | None:
        return median(self.bookkeeping)

    @property
    def beyond_bookkeeping_s(self) -> float | None:
        over, book = self.overhead_s, self.bookkeeping_s
        return over - book if over is not None and book is not None else None

    @property
    def outside_tasks_s(self) -> float | None:
        return median(r.run.record.outside_tasks_s for r in self.redeploys)

    @property
    def ready_lag_s(self) -> float | None:
        return median(r.ready_lag_s for r in self.redeploys)

    @property
    def crash_lag_s(self) -> float | None:
        return median(c.failed_lag_s for c in self.crashes)

    @property
    def crash_noticed_s(self) -> float | None:
        return median(c.noticed_lag_s for c in self.crashes)

    @property
    def ensure_s(self) -> float | None:
        return median(e.wall_s for e in self.ensures)

    @property
    def ensure_restarts(self) -> int | None:
        return max((e.restarts for e in self.ensures), default=None)

    def typical(self) -> Redeploy | None:
        """The redeploy whose wall time is the median (the one the timeline shows)."""
        ranked = sorted(self.redeploys, key=lambda r: r.run.wall_s)
        return ranked[(len(ranked) - 1) // 2] if ranked else None

    def step_s(self) -> dict[str, float]:
        """Median duration of each step (per-node steps: first start to last end), plus the
        flow's time before its first and after its last task run and the stand-in's start;
        then the `ensure` runs' steps, and the steps only a failed run has (diagnostics...)."""
        samples: dict[str, list[float]] = {}

        def add(name: str, seconds: float) -> None:
            samples.setdefault(name, []).append(seconds)

        for r in self.redeploys:
            for name, seconds in step_durations(r.run).items():
                add(name, seconds)
        for e in self.ensures:
            for name, seconds in step_durations(e.run).items():
                add(f"ensure: {name}", seconds)
        for c in self.crashes:
            for name, seconds in step_durations(c.run).items():
                if name not in samples or name.startswith("(flow) last"):
                    add(f"crash: {name}", seconds)
            failed = c.run.record.state_time
            if failed is not None and c.run.record.tasks:
                add("crash: last task to Failed", failed - max(t.end for t in c.run.record.tasks))
        return {name: statistics.median(values) for name, values in samples.items()}

    def step_costs(self, meter: Meter) -> dict[str, StepCost]:
        """What each step cost the product (median over runs, field by field): the Ray
        redeploys' steps and the whole run, then the mp redeploys', `ensure`'s and a crash's."""
        samples: dict[str, list[StepCost]] = {}
        runs = [
            *(("", r.run) for r in self.redeploys),
            *(("mp: ", r.run) for r in self.mp_redeploys),
            *(("ensure: ", e.run) for e in self.ensures),
            *(("crash: ", c.run) for c in self.crashes),
        ]
        for prefix, run in runs:
            for step, (begin, end) in step_spans(run).items():
                cost = meter.cost(begin, end, SPAN_SLACK_S)
                samples.setdefault(prefix + step, []).append(cost)
            whole = meter.cost(run.started, run.started + run.wall_s)
            samples.setdefault(f"{prefix}(whole run)", []).append(whole)
        return {name: median_cost(costs) for name, costs in samples.items()}


def preflight_split(bench: Bench) -> tuple[list[float], list[float]]:
    """Preflight's duration in the runs that asked the image (its facts not cached yet: an
    `image-facts` task run ran) and in those that found them cached."""
    asked: list[float] = []
    cached: list[float] = []
    for per in bench.per_nodes.values():
        for r in [*per.redeploys, *per.mp_redeploys]:
            seconds = step_durations(r.run).get("preflight")
            if seconds is not None:
                tasks = r.run.record.tasks
                ran = any(t.step == "image-facts" and t.state_name != "Cached" for t in tasks)
                (asked if ran else cached).append(seconds)
    return asked, cached


def step_spans(run: FlowRun) -> dict[str, tuple[float, float]]:
    """Each step's first start and last end over its task runs (unix seconds)."""
    spans: dict[str, tuple[float, float]] = {}
    for t in run.record.tasks:
        begin, end = spans.get(t.step, (t.start, t.end))
        spans[t.step] = (min(begin, t.start), max(end, t.end))
    return spans


def step_durations(run: FlowRun) -> dict[str, float]:
    found = {step: end - begin for step, (begin, end) in step_spans(run).items()}
    if run.record.tasks:
        found["(flow) call to first task"] = run.record.tasks[0].start - run.started
        last = max(t.end for t in run.record.tasks)
        found["(flow) last task to return"] = run.started + run.wall_s - last
    if "started" in run.engine and "loading" in run.engine:
        found["(stand-in) engine start to loading"] = run.engine["loading"] - run.engine["started"]
    if run.ray:  # Ray's own start on this bed: what ray-head to cluster-check cannot go below
        found["(Ray) `ray start` alone, slowest node"] = run.ray["slowest_s"]
        found["(Ray) head's container start → last node registered"] = run.ray["all_s"]
    return found


def reference_steps(ref: ReferenceRun) -> dict[str, float]:
    ordered = sorted(ref.marks.items(), key=lambda kv: kv[1])
    return {
        REFERENCE_STEPS.get(step, step): stamp - ordered[i - 1][1]
        for i, (step, stamp) in enumerate(ordered)
        if i > 0
    }


@dataclass
class Extras:
    """Figures measured once, on the smallest bed."""

    nodes: int
    webhook_s: list[float] = field(default_factory=list)
    probe_cold_s: list[float] = field(default_factory=list)
    run_temporary_s: list[float] = field(default_factory=list)
    run_server_s: list[float] = field(default_factory=list)
    references: dict[float, list[ReferenceRun]] = field(default_factory=dict)
    # Every node reports its new boot (the webhook's default wait, reboot_delay_s): the last
    # node's call to the after-reboot run Running.
    reboot_all_s: list[float] = field(default_factory=list)
    reboot_delay_s: float = 0.0
    caches: CacheStarts | None = None  # the real engine's starts with and without [cache]

    def reference(self, poll_s: float) -> dict[str, float | None]:
        runs = self.references.get(poll_s, [])
        return {
            "wall_s": median(r.wall_s for r in runs),
            "overhead_s": median(r.overhead_s for r in runs),
            "ready_lag_s": median(r.ready_lag_s for r in runs),
        }

    def reference_step_s(self, poll_s: float) -> dict[str, float]:
        samples: dict[str, list[float]] = {}
        for ref in self.references.get(poll_s, []):
            for name, seconds in reference_steps(ref).items():
                samples.setdefault(name, []).append(seconds)
        return {name: statistics.median(values) for name, values in samples.items()}


@dataclass
class Bench:
    runs: int
    load_s: float
    crash_load_s: float
    per_nodes: dict[int, PerNodes] = field(default_factory=dict)
    extras: Extras | None = None
    meter: Meter | None = None  # every node call and CPU sample of the whole benchmark
    floors: Floors | None = None  # measured by hand on the smallest bed

    @property
    def smallest(self) -> PerNodes:
        return self.per_nodes[min(self.per_nodes)]

    @property
    def largest(self) -> PerNodes:
        return self.per_nodes[max(self.per_nodes)]

    def scaling_of(self, backend: str) -> float | None:
        small, large = self.smallest.overhead_of(backend), self.largest.overhead_of(backend)
        if small is None or large is None or len(self.per_nodes) < 2 or small <= 0:
            return None
        return large / small

    @property
    def scaling(self) -> float | None:
        small, large = self.smallest.overhead_s, self.largest.overhead_s
        if small is None or large is None or len(self.per_nodes) < 2 or small <= 0:
            return None
        return large / small
