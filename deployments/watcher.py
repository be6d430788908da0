"""`vllm-redeploy watch`: one long-running process that watches one or more clusters between runs.

Every ``[watch] interval_s`` it looks at each cluster (every member's container, /health,
/v1/models naming the served model: ``collect_status(quick=True)``, no probe); every
``generate_every`` looks it also sends a 1-token generation, as a hung group answers /health
with 200 (vllm_redeploy/generation.py), and a hang it found counts in every look until the next
generation says otherwise. After
``failures`` bad looks in a row, posts ``vllm.cluster.unhealthy`` to Prefect; the cluster's
``<cluster>-recover`` deployment turns that into an ``ensure`` run. A process rather than a
scheduled flow: a look every 15 s as a flow run would fill the UI with thousands of runs a day
and cost each look a run's overhead; the process only talks to Prefect when something happens.

Crash-loop protection is kept in Prefect (the recover deployment's run history and a Variable),
so a restarted watcher picks up where the last one was: it reports a cluster again only after the
backoff since the last recovery (``backoff_s``, then 4 times more), and past ``max_recoveries``
in ``window_s`` it marks the cluster crash-looping and posts ``vllm.cluster.crashloop`` once
instead.

It also posts the reboots the webhook keeps in its spool (``deployments.forwarder``): the
webhook, which the network reaches, holds no Prefect credential.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import sysconfig
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import httpx
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOrder,
    EventResourceFilter,
)

from deployments.event_sender import EventSender
from deployments.forwarder import Forwarder
from deployments.metrics import LookFacts, RunFacts, WatchMetrics, nodes_up, reasons_of
from deployments.now_artifact import NowArtifact, now_markdown
from deployments.spool import spool_of
from tasks.standing.lock import holder
from tasks.standing.marks import BEAT_S, beat_watcher, read_standing
from tasks.standing.recoveries import declare_crashloop, pace, read_recover_runs
from tasks.standing.runs import last_runs
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.endpoint import api_base, refused_key
from vllm_redeploy.events import EVENT_READY, cluster_resource, unhealthy_event
from vllm_redeploy.generation import METRICS_TIMEOUT, read_counters
from vllm_redeploy.safe_text import one_line
from vllm_redeploy.status import ClusterStatus, collect_status, duration
from vllm_redeploy.watch import Look, WatchState, judge_look

log = logging.getLogger("vllm_redeploy.watch")
UNDER_WAY = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]
READY_LATE = timedelta(minutes=5)  # how long a run's ready event is waited for
UNDER_WAY_NAMES = {"Scheduled", "Pending", "Running", "Late", "AwaitingRetry", "Retrying"}


@dataclass
class ClusterWatcher:
    config: ClusterConfig
    sender: EventSender
    state: WatchState = field(default_factory=WatchState)
    looks: int = 0
    hang: str | None = None  # what the last generation found wrong, until the next one
    metrics: WatchMetrics | None = None
    now: NowArtifact | None = None  # the "cluster now" view in the UI
    answered_s: float | None = None  # the last generation's latency, when it answered
    last_run: str | None = None  # in words, for the view
    seen: tuple[LookFacts, tuple[str, ...]] | None = None  # the last look's facts, problems
    ready_pending: bool = False  # the last run that served has no ready event stored yet

    def look_once(self) -> None:
        """One look, and what follows from it."""
        config = self.config
        every = config.watch.generate_every
        generate = every > 0 and self.looks % every == 0
        self.looks += 1
        started = time.monotonic()
        status = collect_status(config, quick=True, generate=generate)
        if refused_key(status.endpoint.models_error):
            self.state = WatchState()  # the engine answers: it is the watcher that lacks the key
            log.warning(
                "%s: the engine refuses the watcher's requests (%s). A redeploy would not give "
                "the watcher the key, so no recovery is started: set the secret where the "
                "watcher reads it (VLLM_REDEPLOY_SECRETS__VLLM_API_KEY in the cluster's env "
                "file, then `vllm-redeploy install-controller` again, which restarts it)",
                config.name, one_line(status.endpoint.models_error),
            )  # fmt: skip
            return
        if generate:
            found = status.endpoint.generation
            self.hang = found.problem if found is not None else None
            if found is not None and found.verdict == "busy":
                log.info("%s: %s", config.name, found.detail)
            if found is not None and found.verdict == "answered":
                self.answered_s = found.elapsed_s
        problems = tuple(status.problems)
        if self.hang is not None and self.hang not in problems and status.endpoint.models:
            problems += (self.hang,)
        standing = read_standing(config.name)
        look = Look(problems, busy=busy(config), held_back=standing.headline() is not None)
        self.state, report = judge_look(self.state, look, datetime.now(UTC), config.watch.failures)
        verdict = (
            "busy" if look.busy
            else "paused" if standing.pause is not None
            else "crashlooping" if standing.crashloop is not None
            else "unhealthy" if problems
            else "healthy"
        )  # fmt: skip
        facts = self._facts(status, verdict, problems, started)
        self.seen = (facts, problems)
        if self.metrics is not None:
            self.metrics.looked(config.name, facts)
        if problems and not report and not self.state.reported and self.state.bad:
            log.info("%s: bad look %d of %d: %s", config.name, self.state.bad,
                     config.watch.failures, one_line("; ".join(problems)))  # fmt: skip
        if report:
            self.report()
        self.show_now()

    def show_now(self, *, again: bool = False) -> None:
        """The UI's view of the cluster, from the last look (Prefect away: said, not fatal)."""
        if self.now is None or self.seen is None:
            return
        facts, problems = self.seen
        try:
            self.now.show(
                now_markdown(self.config.name, facts, problems, self.last_run), again=again
            )
        except Exception as exc:
            log.warning(
                "%s: could not show the cluster in Prefect: %s", self.config.name, one_line(exc)
            )

    def _facts(
        self, status: ClusterStatus, verdict: str, problems: tuple[str, ...], started: float
    ) -> LookFacts:
        engine = None
        if self.metrics is not None and status.endpoint.models is not None:  # one more GET
            with httpx.Client(timeout=METRICS_TIMEOUT) as client:
                engine = read_counters(client, api_base(self.config))
        up = nodes_up(self.config, status)
        reasons = reasons_of(status, up)
        if self.hang is not None and self.hang in problems:
            reasons |= {"hang"}
        return LookFacts(
            verdict,
            reasons if problems else frozenset(),
            self.state.bad,
            time.time(),
            time.monotonic() - started,
            up,
            self.answered_s,
            engine,
        )

    def tell_last_run(self) -> None:
        """The cluster's last run that ended and its recoveries, for the metrics and the view."""
        if self.metrics is None and self.now is None:
            return
        found = [r for r in last_runs(self.config, 10) if r.state not in UNDER_WAY_NAMES]
        ended = next(iter(found), None)
        if ended is None or ended.started is None:
            return
        end = ended.started + timedelta(seconds=ended.seconds or 0.0)
        self.last_run = (
            f"{ended.name}, {ended.state} at {end.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC after "
            f"{duration(ended.seconds)}" + (f": {ended.failure}" if ended.failure else "")
        )
        if self.metrics is None:
            return
        served = next((r for r in found if r.state == "Completed" and r.mode != "stop"), None)
        steps, probe_s, weights = last_ready(self.config.name)
        # Prefect stores a run's events a moment after the run ends: ask again at the next
        # looks, for a while, rather than at the next beat.
        self.ready_pending = (
            steps is None and served is not None and end > datetime.now(UTC) - READY_LATE
        )
        self.metrics.ran(
            self.config.name,
            RunFacts(
                ended.state == "Completed",
                end.timestamp(),
                ended.seconds or 0.0,
                served.seconds if served is not None else None,
                pace(self.config.name, self.config.watch).count,
                steps,
                probe_s,
                weights,
            ),
        )

    def report(self) -> None:
        """Tell Prefect: unhealthy, or crash-looping when recoveries are used up; hold the report
        back while the last recovery's backoff lasts."""
        config = self.config
        now = pace(config.name, config.watch)
        if now.crashloop:
            _, event = declare_crashloop(config.name, config.watch, now)
            occurred = datetime.now(UTC).isoformat()
            self.sender.submit({**event, "id": str(uuid.uuid4()), "occurred": occurred})
            log.warning(
                "%s: crash-looping after %d recoveries; told Prefect", config.name, now.count
            )
            return
        if now.wait_s > 0:
            log.info("%s: unhealthy; next recovery allowed in %.0f s", config.name, now.wait_s)
            self.state = WatchState(self.state.bad, self.state.since, False, self.state.problems)
            return
        assert self.state.since is not None
        self.sender.submit(
            unhealthy_event(config.name, list(self.state.problems), self.state.since)
        )
        log.warning("%s: unhealthy since %s: %s", config.name, self.state.since.isoformat(),
                    one_line("; ".join(self.state.problems)))  # fmt: skip


class Ready(NamedTuple):
    """What the last ``vllm.cluster.ready`` event says of the run that served."""

    steps: dict[str, float] | None
    probe_s: float | None
    weights: tuple[str, float] | None  # (loader, vLLM's seconds), when that run loaded them


def last_ready(cluster: str) -> Ready:
    """The steps (step -> seconds), the probe's time and the weights' load of the cluster's
    last run that served, from its ``vllm.cluster.ready`` event (the last 180 days')."""
    with get_client(sync_client=True) as client:
        page = client.read_events(
            filter=EventFilter(
                event=EventNameFilter(name=[EVENT_READY]),
                resource=EventResourceFilter(id=[cluster_resource(cluster)["prefect.resource.id"]]),
                order=EventOrder.DESC,
            ),
            limit=1,
        )
    if not page.events:
        return Ready(None, None, None)
    payload = page.events[0].payload
    steps, probe_s = payload.get("steps"), payload.get("probe_s")
    loader, weights_s = payload.get("loader"), payload.get("weights_s")
    return Ready(
        {str(k): float(v) for k, v in steps.items()} if isinstance(steps, dict) else None,
        float(probe_s) if isinstance(probe_s, int | float) else None,
        (str(loader), float(weights_s))
        if isinstance(loader, str) and isinstance(weights_s, int | float)
        else None,
    )


def busy(config: ClusterConfig) -> bool:
    """Is a run of the cluster under way: holding it (its lock names a live holder), or a
    recovery already on its way (scheduled, pending, running: a restarted watcher must not ask
    twice)? A slot the server counts for a finished run (a restart lost its lease) is not."""
    if holder(config) is not None:
        return True
    with get_client(sync_client=True) as client:
        under_way = FlowRunFilterState(type=FlowRunFilterStateType(any_=UNDER_WAY))
        return bool(read_recover_runs(client, config.name, FlowRunFilter(state=under_way), limit=1))


def watch_clusters(
    configs: list[ClusterConfig],
    stop: threading.Event | None = None,
    metrics: WatchMetrics | None = None,
) -> None:
    """Watch every cluster on its own thread until ``stop`` is set (or the process ends);
    with ``metrics``, tell it what each look saw."""
    stop = stop or threading.Event()
    sender = EventSender()
    threads = [
        threading.Thread(
            target=_loop,
            args=(ClusterWatcher(c, sender, metrics=metrics, now=NowArtifact(c.name)), stop),
            name=c.name,
        )
        for c in configs
    ]
    # The reboots the webhook accepted: it holds no Prefect credential, so they go from here.
    threads += [
        threading.Thread(
            target=Forwarder(c, spool_of(c), sender.adopt).run, args=(stop,), name=f"{c.name}-spool"
        )
        for c in configs
    ]
    for thread in threads:
        thread.start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        sender.close(timeout=10)


def _loop(watcher: ClusterWatcher, stop: threading.Event) -> None:
    name, interval = watcher.config.name, watcher.config.watch.interval_s
    log.info("watching %s every %g s", name, interval)
    beaten = -BEAT_S
    while not stop.is_set():
        started = time.monotonic()
        _look_watched(watcher, stop)
        if started - beaten >= BEAT_S:
            try:
                beat_watcher(name, interval)
                watcher.tell_last_run()
                watcher.show_now(again=True)  # the time of the last look, once a minute
                beaten = started
            except Exception as exc:  # Prefect away: said at the next beat
                log.warning("%s: could not say in Prefect that it watches: %s", name, one_line(exc))
        elif watcher.ready_pending:
            with contextlib.suppress(Exception):  # asked again at the next look
                watcher.tell_last_run()
        stop.wait(max(0.0, interval - (time.monotonic() - started)))


def _look_watched(watcher: ClusterWatcher, stop: threading.Event) -> None:
    """One look, under a watchdog: every read of a look has its own deadline, so one that
    outlasts ``look_limit_s`` is a bug; it is said, with where it waits, until it ends (the next
    look waits for it: two looks at once would count one failure twice)."""
    name = watcher.config.name

    def look() -> None:
        try:
            watcher.look_once()
        except Exception as exc:  # a look that failed says nothing about the cluster
            log.warning("%s: could not look: %s", name, one_line(exc))

    thread = threading.Thread(target=look, name=f"{name}-look", daemon=True)
    thread.start()
    limit = look_limit_s(watcher.config)
    while True:
        thread.join(limit)
        if not thread.is_alive() or stop.is_set():
            return
        log.warning("%s: a look has taken more than %.0f s, still waiting in %s",
                    name, limit, _where(thread))  # fmt: skip


_LIBRARIES = tuple({sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")})


def _where(thread: threading.Thread) -> str:
    """The innermost line of ours (not Python's or a library's) that ``thread`` is running."""
    frame = sys._current_frames().get(thread.ident or 0)
    stack = traceback.extract_stack(frame) if frame is not None else []
    ours = [f for f in stack if not f.filename.startswith(_LIBRARIES)] or stack
    if not ours:
        return "an unknown place"
    f = ours[-1]
    return one_line(f"{f.name} ({Path(f.filename).name}:{f.lineno}: {f.line})")


def look_limit_s(config: ClusterConfig) -> float:
    """How long a look may take: its slowest parts are the generation and SSH commands."""
    return max(2 * config.watch.interval_s, config.watch.generate_timeout_s + 60.0)
