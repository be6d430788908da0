"""A cluster's recoveries, from Prefect's own run history (the ``<cluster>-recover``
deployment's runs that acted), so that the count survives a restart of every process: how many
in the window, how long the next must wait (its backoff), when they are used up (crash-looping),
and whether one is under way. The guard and the watcher both judge by :func:`pace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import get_client, runtime
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

from tasks.standing.marks import (
    Crashloop,
    mark_crashloop,
    recoveries_counted_from,
    short_reason,
)
from vllm_redeploy.config import WatchConfig
from vllm_redeploy.events import crashloop_event
from vllm_redeploy.names import deployment_name
from vllm_redeploy.watch import backoff_s

SKIPPED = "Skipped"  # the final state's name of a run that changed nothing on purpose
UNCHANGED = "Unchanged"  # ensure found the cluster healthy
RECOVER = "recover"  # the trigger, and the deployment's name after the cluster's


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
            name=DeploymentFilterName(any_=[deployment_name(cluster, RECOVER)])
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
