"""A cluster's standing with people and with its own recoveries, kept in Prefect Variables so that
it survives a restart of every process: paused for maintenance (by whom, why, until when), or
crash-looping (automatic runs stopped). `vllm-redeploy pause` / `resume` write it; the watcher
and every run read it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect.variables import Variable

from vllm_redeploy.names import variable_name
from vllm_redeploy.safe_text import one_line

PAUSE = "pause"
CRASHLOOP = "crashloop"
COUNT_FROM = "recoveries_counted_from"  # a person's resume starts the crash-loop count anew
WATCHER = "watcher"  # the watcher's last look: that it runs, for status and doctor
BEAT_S = 60.0  # how often the watcher says so: one write a minute, not one per look


@dataclass(frozen=True)
class Pause:
    reason: str
    by: str
    since: str
    until: str | None  # ISO time; None: until `resume`

    def describe(self) -> str:
        until = f" until {self.until}" if self.until else " until `vllm-redeploy resume`"
        return f"paused by {self.by} since {self.since}{until}: {self.reason}"


@dataclass(frozen=True)
class Crashloop:
    since: str
    recoveries: int
    reasons: tuple[str, ...]

    def describe(self) -> str:
        last = f"; last: {self.reasons[-1]}" if self.reasons else ""
        return (
            f"crash-looping since {self.since} ({self.recoveries} recoveries in the window "
            f"failed to keep it up){last}; no automatic run touches it until "
            "`vllm-redeploy resume` or a manual run succeeds"
        )


@dataclass(frozen=True)
class Standing:
    pause: Pause | None = None
    crashloop: Crashloop | None = None

    def headline(self) -> str | None:
        """``paused ...`` or ``crash-looping ...``, or None when neither."""
        if self.pause is not None:
            return self.pause.describe()
        if self.crashloop is not None:
            return self.crashloop.describe()
        return None


def read_standing(cluster: str, now: datetime | None = None) -> Standing:
    """The cluster's pause (an expired one counts as none) and crash-loop mark."""
    now = now or datetime.now(UTC)
    pause = _get(cluster, PAUSE)
    loop = _get(cluster, CRASHLOOP)
    found_pause = None
    if isinstance(pause, dict) and pause.get("reason") is not None:
        until = pause.get("until")
        if not until or datetime.fromisoformat(str(until)) > now:
            found_pause = Pause(str(pause["reason"]), str(pause.get("by", "?")),
                                str(pause.get("since", "?")), until)  # fmt: skip
    found_loop = None
    if isinstance(loop, dict) and loop.get("since"):
        found_loop = Crashloop(
            str(loop["since"]), int(loop.get("recoveries", 0)), tuple(loop.get("reasons", ()))
        )
    return Standing(found_pause, found_loop)


def pause(cluster: str, reason: str, for_s: float | None = None, by: str | None = None) -> Pause:
    now = datetime.now(UTC)
    until = (now + timedelta(seconds=for_s)).isoformat(timespec="seconds") if for_s else None
    value = Pause(reason, by or who(), now.isoformat(timespec="seconds"), until)
    Variable.set(variable_name(cluster, PAUSE), value.__dict__, overwrite=True)
    return value


def resume(cluster: str) -> list[str]:
    """Clear the pause and the crash-loop mark, and count recoveries from now; what was
    cleared."""
    cleared = []
    for what in (PAUSE, CRASHLOOP):
        if _get(cluster, what) is not None:
            Variable.unset(variable_name(cluster, what))
            cleared.append(what)
    _count_from_now(cluster)
    return cleared


def mark_crashloop(cluster: str, recoveries: int, reasons: list[str]) -> Crashloop:
    """Mark the cluster crash-looping; ``reasons``: the failed recoveries' messages (their first
    lines are kept: a Variable holds 5000 characters at most)."""
    reasons = [short_reason(r) for r in reasons]
    value = Crashloop(datetime.now(UTC).isoformat(timespec="seconds"), recoveries, tuple(reasons))
    data = {"since": value.since, "recoveries": recoveries, "reasons": list(reasons)}
    Variable.set(variable_name(cluster, CRASHLOOP), data, overwrite=True)
    return value


def clear_crashloop(cluster: str) -> bool:
    """A manual run succeeded: the crash-loop mark goes, and the count starts anew."""
    if _get(cluster, CRASHLOOP) is None:
        return False
    Variable.unset(variable_name(cluster, CRASHLOOP))
    _count_from_now(cluster)
    return True


def recoveries_counted_from(cluster: str) -> datetime | None:
    """Since when recoveries count toward a crash loop (the last resume), if ever set."""
    value = _get(cluster, COUNT_FROM)
    with contextlib.suppress(TypeError, ValueError):
        return datetime.fromisoformat(str(value)) if value else None
    return None


def _count_from_now(cluster: str) -> None:
    now = datetime.now(UTC).isoformat(timespec="seconds")
    Variable.set(variable_name(cluster, COUNT_FROM), now, overwrite=True)


def short_reason(reason: str, limit: int = 400) -> str:
    """A run's failure in one short line: its first line (the log tail after it is left out)."""
    first = one_line(reason.strip().split("\n", 1)[0])
    return first if len(first) <= limit else first[: limit - 1] + "…"


def who() -> str:
    """user@host of whoever pauses: the person, or the service account."""
    user = "unknown"
    with contextlib.suppress(Exception):
        user = getpass.getuser()
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class WatcherBeat:
    """The watcher's word that it looks at the cluster: when it last did, from where."""

    at: datetime
    by: str  # user@host
    pid: int
    every_s: float  # its look interval

    def age_s(self, now: datetime | None = None) -> float:
        return ((now or datetime.now(UTC)) - self.at).total_seconds()

    def alive(self, now: datetime | None = None) -> bool:
        """Did it say so lately (two beats and a look, for a slow look or a late write)?"""
        return self.age_s(now) <= 2 * BEAT_S + self.every_s

    def describe(self, now: datetime | None = None) -> str:
        return (
            f"last word {self.age_s(now):.0f} s ago ({self.by}, pid {self.pid}; it looks every "
            f"{self.every_s:g} s)"
        )


def beat_watcher(cluster: str, every_s: float) -> None:
    value = {
        "at": datetime.now(UTC).isoformat(),
        "by": who(),
        "pid": os.getpid(),
        "every_s": every_s,
    }
    Variable.set(variable_name(cluster, WATCHER), value, overwrite=True)


def watcher_beat(cluster: str) -> WatcherBeat | None:
    """The watcher's last word, or None when no watcher ever looked at the cluster."""
    value = _get(cluster, WATCHER)
    with contextlib.suppress(TypeError, ValueError, KeyError):
        return WatcherBeat(
            datetime.fromisoformat(str(value["at"])),
            str(value["by"]),
            int(value["pid"]),
            float(value["every_s"]),
        )
    return None


def _get(cluster: str, what: str) -> Any:
    return Variable.get(variable_name(cluster, what), default=None)
