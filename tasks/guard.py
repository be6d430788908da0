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

The guard runs before the run takes the cluster: a waiting recovery holds nothing. A pause (or a
crash-loop mark) can come while a run waits for the cluster, sleeps its backoff, or works: the
run reads the standing again once it holds the cluster and before every step that changes the
nodes (``stand``). Paused before its first change, it ends Skipped; paused later, it finishes the
step in flight and stops there, Cancelled, leaving the nodes as they are: a pause means a
person's hands are on them, and a run that went on launching (or tore down what it started)
would work against them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from tasks.context import Run, log
from tasks.records import on_own_schedule
from tasks.standing.marks import read_standing
from tasks.standing.recoveries import (
    RECOVER,
    declare_crashloop,
    pace,
    recovery_under_way,
)
from vllm_redeploy.safe_text import one_line
from vllm_redeploy.watch import backoff_s

Trigger = Literal["manual", "nightly", "after-reboot", "recover"]


@dataclass(frozen=True)
class Guard:
    skip: str | None  # why this run changes nothing; None: go on
    waited_s: float = 0.0


class HandsOff(Exception):
    """The cluster was paused (or marked crash-looping) after this run's guard."""

    def __init__(self, reason: str, before: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.before = before  # the step this run did not start


# Not cached: the standing is only true now.
@task(name="guard", task_run_name="guard", cache_policy=NO_CACHE)
def guard_run(run: Run, trigger: Trigger, override_pause: bool) -> Guard:
    reason = _unwelcome(run.config.name, trigger, override_pause)
    if reason is not None:
        return _skip(reason)
    if trigger != RECOVER:
        return Guard(None)
    return _pace(run)


def stand(run: Run, trigger: Trigger, override_pause: bool) -> None:
    """Raise HandsOff if the cluster was paused or marked crash-looping since the guard. The
    Prefect API away goes on: the run has just confirmed its hold there, and a pause cannot be
    written while the server is away."""
    try:
        reason = on_own_schedule(_unwelcome)(run.config.name, trigger, override_pause)
    except Exception as exc:
        log().warning("could not read the cluster's pause and crash-loop mark: %s", one_line(exc))
        return
    if reason is not None:
        raise HandsOff(reason)


def _unwelcome(cluster: str, trigger: Trigger, override_pause: bool) -> str | None:
    """Why the cluster's standing keeps this run's hands off it; None when it does not."""
    standing = read_standing(cluster)
    if standing.pause is not None and (trigger != "manual" or not override_pause):
        return standing.pause.describe()
    if standing.crashloop is not None and trigger != "manual":
        return standing.crashloop.describe()
    return None


def _pace(run: Run) -> Guard:
    cluster, watch = run.config.name, run.config.watch
    ahead = recovery_under_way(cluster)
    if ahead is not None:
        since = ahead.start_time.isoformat(timespec="seconds") if ahead.start_time else "?"
        return _skip(f"recovery {ahead.name} is under way since {since}; this one would repeat it")
    now = pace(cluster, watch)
    if now.crashloop:
        loop, event = declare_crashloop(cluster, watch, now)
        run.records.record("crashloop-event", lambda: emit_event(**event))
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


def _skip(reason: str) -> Guard:
    log().warning("changing nothing: %s", reason)
    return Guard(reason)
