"""Step "guard": should this run touch the cluster at all, and when?

- Paused (`vllm-redeploy pause`): every run but a manual one with ``override_pause`` changes
  nothing and ends Skipped, saying who paused it and why.
- Crash-looping: automatic runs (nightly, after-reboot, recover) end Skipped until a person runs
  `vllm-redeploy resume`, or a manual run succeeds.
- A recovery (the watcher's ``vllm.cluster.unhealthy``) is the n-th of the window: past
  ``[watch] max_recoveries`` it marks the cluster crash-looping, emits ``vllm.cluster.crashloop``
  once and ends Skipped; otherwise it waits its backoff (``backoff_s``, then 4 times more each
  time) after the last recovery ended. The count is Prefect's own run history (the
  ``<cluster>-recover`` deployment's runs that acted), so it survives a restart of every process.

A recovery while another is under way (running, even just ending: a run lets go of the cluster
before Prefect marks it Failed) changes nothing: the earlier one is the answer to the same
failure. The deployment's concurrency limit usually queues the second; this holds whatever lets
two through (seen once across a controller restart: the stopping watcher flushed its report and
the new one reported the same failure again). A recovery left running by a killed controller
holds the next ones back until Prefect marks it Crashed, as it holds back the watcher.

The guard runs before the run takes the cluster: a waiting recovery holds nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from prefect import get_client, runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterStartTime,
    FlowRunFilterState,
    FlowRunFilterStateName,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.events import emit_event

from deployments.cluster_state import (
    Crashloop,
    mark_crashloop,
    read_standing,
    recoveries_counted_from,
    short_reason,
)
from tasks.context import Run, log
from vllm_redeploy.config import WatchConfig
from vllm_redeploy.events import crashloop_event
from vllm_redeploy.watch import backoff_s

Trigger = Literal["manual", "nightly", "after-reboot", "recover"]
SKIPPED = "Skipped"  # the final state's name of a run that changed nothing on purpose
UNCHANGED = "Unchanged"  # ensure found the cluster healthy
RECOVER = "recover"


@dataclass(frozen=True)
class Guard:
    skip: str | None  # why this run changes nothing; None: go on
    waited_s: float = 0.0


def recover_deployment(cluster: str) -> str:
    return f"{cluster}-{RECOVER}"


# Not cached: the standing is only true now.
@task(name="guard", cache_policy=NO_CACHE)
def guard_run(run: Run, trigger: Trigger, override_pause: bool) -> Guard:
    cluster = run.config.name
    standing = read_standing(cluster)
    if standing.pause is not None and (trigger != "manual" or not override_pause):
        return _skip(standing.pause.describe())
    if standing.crashloop is not None and trigger != "manual":
        return _skip(standing.crashloop.describe())
    if trigger != RECOVER:
        return Guard(None)
    return _pace(run)


def _pace(run: Run) -> Guard:
    cluster, watch = run.config.name, run.config.watch
    ahead = recovery_under_way(cluster)
    if ahead is not None:
        since = ahead.start_time.isoformat(timespec="seconds") if ahead.start_time else "?"
        return _skip(f"recovery {ahead.name} is under way since {since}; this one would repeat it")
    now = pace(cluster, watch)
    if now.crashloop:
        loop, event = declare_crashloop(cluster, watch, now)
        emit_event(**event)
        log().warning("%s is crash-looping: %d recoveries in %g s", cluster, now.count,
                      watch.window_s)  # fmt: skip
        return _skip(loop.describe())
    if now.wait_s > 0:
        log().info(
            "recovery %d of %d in the window: waiting %.0f s (backoff %g s after the last)",
            now.count + 1,
            watch.max_recoveries,
            now.wait_s,
            backoff_s(watch.backoff_s, now.count),
        )
        time.sleep(now.wait_s)
    return Guard(None, now.wait_s)


@dataclass(frozen=True)
class Pace:
    """Where a cluster stands in its recovery window; the guard and the watcher both judge by it."""

    count: int  # the recoveries that acted in the window
    reasons: tuple[str, ...]  # the last (three at most) failures' first lines
    crashloop: bool  # the recoveries are used up
    wait_s: float  # how long the next recovery must still wait (its backoff); 0: none


def pace(cluster: str, watch: WatchConfig) -> Pace:
    past = recoveries(cluster, watch.window_s)
    if not past:
        return Pace(0, (), False, 0.0)
    reasons = [short_reason(r.state.message) for r in past if r.state and r.state.message]
    last_end = max(r.end_time or r.start_time or datetime.now(UTC) for r in past)
    elapsed = (datetime.now(UTC) - last_end).total_seconds()
    wait = max(backoff_s(watch.backoff_s, len(past)) - elapsed, 0.0)
    return Pace(len(past), tuple(reasons[-3:]), len(past) >= watch.max_recoveries, wait)


def declare_crashloop(
    cluster: str, watch: WatchConfig, now: Pace
) -> tuple[Crashloop, dict[str, Any]]:
    """Mark the cluster crash-looping; the mark, and the ``vllm.cluster.crashloop`` event's
    arguments for the caller to send its own way."""
    loop = mark_crashloop(cluster, now.count, list(now.reasons))
    return loop, crashloop_event(cluster, now.count, watch.window_s, list(now.reasons))


def read_recover_runs(
    client: SyncPrefectClient, cluster: str, runs: FlowRunFilter, **options: Any
) -> list[FlowRun]:
    """The cluster's ``<cluster>-recover`` runs that ``runs`` selects."""
    return client.read_flow_runs(
        deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[recover_deployment(cluster)])
        ),
        flow_run_filter=runs,
        **options,
    )


def recoveries(cluster: str, window_s: float) -> list[FlowRun]:
    """This cluster's recovery runs that acted (redeployed or failed) in the last ``window_s``
    and since the last `resume`, this one left out, oldest first."""
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    since = max(since, recoveries_counted_from(cluster) or since)
    done = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED]
    with get_client(sync_client=True) as client:
        found = read_recover_runs(
            client,
            cluster,
            FlowRunFilter(
                start_time=FlowRunFilterStartTime(after_=since),
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=done),
                    name=FlowRunFilterStateName(not_any_=[SKIPPED, UNCHANGED]),
                ),
                id=FlowRunFilterId(not_any_=[runtime.flow_run.id] if runtime.flow_run.id else []),
            ),
            sort=FlowRunSort.START_TIME_ASC,
        )
    return list(found)


def recovery_under_way(cluster: str) -> FlowRun | None:
    """The first other recovery of this cluster that is running and started before this one."""
    me = runtime.flow_run.id
    with get_client(sync_client=True) as client:
        mine = client.read_flow_run(me).start_time if me else None
        running = read_recover_runs(
            client,
            cluster,
            FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])),
                id=FlowRunFilterId(not_any_=[me] if me else []),
            ),
            sort=FlowRunSort.START_TIME_ASC,
        )
    if mine is None:
        return running[0] if running else None
    ahead = [r for r in running if r.start_time and (r.start_time, str(r.id)) < (mine, str(me))]
    return ahead[0] if ahead else None


def _skip(reason: str) -> Guard:
    log().warning("changing nothing: %s", reason)
    return Guard(reason)
