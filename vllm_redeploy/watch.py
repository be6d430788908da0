"""When the watcher speaks: the judgement of one look at a cluster, given the ones before. No
Prefect and no I/O here; deployments/watcher.py does the looking and the telling.

A look is bad when the one judgement of health (``vllm_redeploy.status.judge``, quick: no probe)
finds a problem. After ``failures`` bad looks in a row the watcher reports the cluster unhealthy,
once: again only after the cluster was healthy in between, or a run of it ended in between (a
recovery that did not bring it back is news). While a run of the cluster is in progress (a
redeploy is not a crash), or the cluster is paused or crash-looping, it counts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime


@dataclass(frozen=True)
class WatchState:
    bad: int = 0  # bad looks in a row
    since: datetime | None = None  # the first of them
    reported: bool = False  # unhealthy was reported for this stretch
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Look:
    problems: tuple[str, ...]  # empty: healthy
    busy: bool = False  # a run of the cluster holds it
    held_back: bool = False  # paused or crash-looping: nothing automatic may touch it


def judge_look(
    state: WatchState, look: Look, now: datetime, failures: int
) -> tuple[WatchState, bool]:
    """The state after ``look``, and whether to report the cluster unhealthy now."""
    if look.busy or look.held_back or not look.problems:
        return WatchState(), False
    if state.reported:
        return replace(state, problems=look.problems), False
    bad = state.bad + 1
    since = state.since or now
    report = bad >= failures
    return WatchState(bad, since, report, look.problems), report


def backoff_s(base_s: float, recoveries: int) -> float:
    """How long after the last recovery the next may start: 0, base, 4 base, 16 base, ..."""
    return 0.0 if recoveries <= 0 else base_s * 4 ** (recoveries - 1)
