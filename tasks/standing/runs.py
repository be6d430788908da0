"""The runs of a cluster under way now: the one holding it and those waiting for it (or asleep in
a recovery's backoff), and what a pause does to each (`vllm-redeploy pause` prints it).

Every run tags itself with its cluster (``cluster:<name>``) as it starts, whatever started it (a
deployment's runs carry the tag already; ``vllm-redeploy run`` and a direct call do not).
"""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_client, runtime
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound
from prefect.utilities.urls import url_for

from tasks.standing.lock import Record, holder
from vllm_redeploy import PROJECT
from vllm_redeploy.config import CONFIG_VARIABLE, ClusterConfig
from vllm_redeploy.names import cluster_tag

UNDER_WAY = [StateType.PENDING, StateType.RUNNING]


@dataclass(frozen=True)
class RunAtHand:
    """A run of the cluster under way, as a person reads it."""

    name: str
    trigger: str  # nightly, after-reboot, recover, manual
    holds: bool  # it holds the cluster now
    overrides: bool  # a manual run started with override_pause: a pause does not stop it
    crashed: bool = False  # marked Crashed in Prefect, yet still beating the lock

    def under_pause(self) -> str:
        """What this run does now that the cluster is paused."""
        if self.overrides:
            return "goes on: a manual run started with override_pause"
        if self.holds:
            return (
                "finishes the step it is in, then changes nothing more (Cancelled, the nodes "
                "left as they are; Skipped if it changed nothing yet)"
            )
        return "ends Skipped when it gets the cluster, changing nothing"

    def line(self) -> str:
        role = "holds the cluster" if self.holds else "waits"
        if self.crashed:
            role += (
                " (marked Crashed in Prefect, yet it still beats the lock: its controller runs it)"
            )
        return f"flow run {self.name} ({self.trigger}) {role}: {self.under_pause()}"


def run_name() -> str:
    """The flow run's name, as Prefect sets it when the run starts: its cluster, trigger and
    mode (``spark-pair-nightly-redeploy``), so that runs of two clusters, a nightly one and a
    recovery, tell themselves apart in the UI. From the parameters and the file's ``name``;
    never raises (the engine would fail the run before its first step)."""
    params = runtime.flow_run.parameters or {}
    return "-".join(
        (
            _cluster_name(params.get("config_path")),
            str(params.get("trigger") or "manual"),
            str(params.get("mode") or "redeploy"),
        )
    )


def named_run() -> str:
    """This flow run in words, for the person who started it: its name and where the UI
    shows it (``flow run spark-pair-manual-redeploy: http://.../runs/flow-run/ID``)."""
    link = url_for("flow-run", obj_id=runtime.flow_run.id) if runtime.flow_run.id else None
    return f"flow run {runtime.flow_run.name}" + (f": {link}" if link else "")


def _cluster_name(config_path: object) -> str:
    served = [p for p in os.environ.get(CONFIG_VARIABLE, "").split(os.pathsep) if p]
    path = config_path if isinstance(config_path, str) else next(iter(served), "")
    try:
        with open(path, "rb") as file:
            name = tomllib.load(file).get("name")
    except (OSError, ValueError):
        name = None
    if isinstance(name, str) and NAME.fullmatch(name):
        return name
    stem = Path(path).stem
    return stem if NAME.fullmatch(stem) else "cluster"


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def tag_this_run(cluster: str) -> None:
    """Tag the running flow run with its cluster (what ``runs_at_hand`` finds it by)."""
    tags = set(runtime.flow_run.tags or ())
    wanted = {PROJECT, cluster_tag(cluster)}
    if runtime.flow_run.id is None or wanted <= tags:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(runtime.flow_run.id, tags=sorted(tags | wanted))


def runs_at_hand(config: ClusterConfig) -> list[RunAtHand]:
    """The cluster's runs under way, the holder first. A holder that Prefect marked Crashed (its
    heartbeats stopped reaching the server) but that still beats the lock is under way too."""
    record = Record.read(config.name)
    held_by = record.flow_run_id if record is not None and not record.released else None
    live = holder(config)
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[cluster_tag(config.name)]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNDER_WAY)),
            ),
            sort=FlowRunSort.START_TIME_ASC,
        )
        if live is not None and all(str(run.id) != live.flow_run_id for run in found):
            with contextlib.suppress(ObjectNotFound, ValueError):
                found = [client.read_flow_run(UUID(live.flow_run_id)), *found]
    runs = [_at_hand(run, str(run.id) == held_by) for run in found]
    return sorted(runs, key=lambda r: not r.holds)


def _at_hand(run: FlowRun, holds: bool) -> RunAtHand:
    trigger = str(run.parameters.get("trigger") or "manual")
    overrides = trigger == "manual" and bool(run.parameters.get("override_pause"))
    crashed = run.state_type == StateType.CRASHED
    return RunAtHand(run.name, trigger, holds, overrides, crashed)


@dataclass(frozen=True)
class PastRun:
    """One run of the cluster, as `vllm-redeploy runs` lists it."""

    name: str
    trigger: str  # nightly, after-reboot, recover, manual
    mode: str  # redeploy, ensure, stop
    state: str  # Prefect's state name: Completed, Failed, Skipped, Cancelled, Running, ...
    started: datetime | None
    seconds: float | None  # how long it ran (so far, for one under way)
    failure: str  # the failed step and why ("probe: empty answer ..."); "" when none
    url: str  # its page in the Prefect UI

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["started"] = self.started.isoformat() if self.started else None
        return data


FAILED_PREFIX = "Flow run encountered an exception: "


def last_runs(config: ClusterConfig, count: int) -> list[PastRun]:
    """The cluster's last ``count`` flow runs that started, newest first (the nightly
    deployment's scheduled ones are `status`'s next run)."""
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[cluster_tag(config.name)]),
                start_time=FlowRunFilterStartTime(is_null_=False),
            ),
            sort=FlowRunSort.START_TIME_DESC,
            limit=count,
        )
    return [_past(run) for run in found]


def past_run(flow_run_id: UUID) -> PastRun:
    """One flow run, as `runs` lists it."""
    with get_client(sync_client=True) as client:
        return _past(client.read_flow_run(flow_run_id))


def _past(run: FlowRun) -> PastRun:
    state = run.state
    failure = ""
    if state is not None and (state.is_failed() or state.is_crashed()):
        failure = (state.message or "").removeprefix(FAILED_PREFIX).removeprefix("StepFailed: ")
    ran = run.total_run_time if run.end_time else run.estimated_run_time
    return PastRun(
        name=run.name,
        trigger=str(run.parameters.get("trigger", "manual")),
        mode=str(run.parameters.get("mode", "redeploy")),
        state=state.name if state is not None and state.name else "?",
        started=run.start_time,
        seconds=ran.total_seconds() if run.start_time else None,
        failure=failure,
        url=url_for("flow-run", obj_id=run.id) or "",
    )


def next_run(config: ClusterConfig) -> tuple[str, datetime] | None:
    """The cluster's next scheduled run (the nightly one, as its deployment scheduled it):
    its trigger and when it is due; None when none is scheduled. (Its name is given when it
    starts.)"""
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[cluster_tag(config.name)]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,
            limit=1,
        )
    if not found or found[0].expected_start_time is None:
        return None
    return str(found[0].parameters.get("trigger", "manual")), found[0].expected_start_time
