"""What the Prefect server recorded about a flow run: its state times and its task runs."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tests.test_deployments import api

_NODE = re.compile(r"^(?P<step>[^\[]+)\[(?P<node>[^\]]+)\]$")


def stamp(value: str | None) -> float | None:
    """A Prefect API timestamp as unix seconds."""
    return datetime.fromisoformat(value).timestamp() if value else None


@dataclass(frozen=True)
class TaskSpan:
    """One task run: ``preflight[node-1]`` is step ``preflight`` on ``node-1``."""

    name: str
    start: float
    end: float
    state: str
    state_name: str = ""  # "Cached" for a task run whose result came from its cache

    @property
    def step(self) -> str:
        match = _NODE.match(self.name)
        return match["step"] if match else _strip_suffix(self.name)

    @property
    def node(self) -> str | None:
        match = _NODE.match(self.name)
        return match["node"] if match else None


def _strip_suffix(name: str) -> str:
    # Prefect names a task run without a task_run_name "<task>-<3 hex>": "wait-ready-4f7".
    return re.sub(r"-([0-9a-f]{3}|\d+)$", "", name)


@dataclass(frozen=True)
class FlowRunRecord:
    id: str
    state: str
    start: float | None
    end: float | None
    state_time: float | None  # when it entered its current state
    tasks: list[TaskSpan]

    @property
    def outside_tasks_s(self) -> float | None:
        """Flow run time not covered by any task run: the flow body's own work plus Prefect's
        bookkeeping between tasks (creating runs, state changes, results)."""
        if self.start is None or self.end is None:
            return None
        covered, reach = 0.0, self.start
        for span in sorted(self.tasks, key=lambda s: s.start):
            begin, finish = max(span.start, reach), min(span.end, self.end)
            if finish > begin:
                covered += finish - begin
                reach = finish
        return (self.end - self.start) - covered


def flow_run(url: str, flow_run_id: str) -> dict[str, Any]:
    return api(url, "GET", f"/flow_runs/{flow_run_id}")


def _task_runs(url: str, flow_run_id: str) -> list[dict[str, Any]]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    return api(url, "POST", "/task_runs/filter", body)


def _final(runs: list[dict[str, Any]]) -> bool:
    return all(r["end_time"] and r["start_time"] for r in runs)


def read_flow_run(url: str, flow_run_id: str, settle_s: float = 1.5) -> FlowRunRecord:
    """The flow run and its task runs. Task run states reach the server asynchronously (as
    events), so read until every task run has ended and two reads ``settle_s`` apart agree."""
    deadline = time.monotonic() + 30
    runs = _task_runs(url, flow_run_id)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        again = _task_runs(url, flow_run_id)
        if _final(again) and len(again) == len(runs):
            runs = again
            break
        runs = again
    run = flow_run(url, flow_run_id)
    spans = [
        TaskSpan(
            r["name"],
            stamp(r["start_time"]) or 0.0,
            stamp(r["end_time"]) or 0.0,
            r["state_type"],
            r.get("state_name") or "",
        )
        for r in runs
        if r["start_time"]
    ]
    state = run.get("state") or {}
    return FlowRunRecord(
        id=flow_run_id,
        state=run["state_type"],
        start=stamp(run["start_time"]),
        end=stamp(run["end_time"]),
        state_time=stamp(state.get("timestamp")),
        tasks=sorted(spans, key=lambda s: s.start),
    )
