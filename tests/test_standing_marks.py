"""What a cluster's marks say, without Prefect: the watcher's word read back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tasks.standing.marks import BEAT_S, WatcherBeat


def test_a_watcher_is_alive_while_its_beats_come_and_silent_after_two_missed() -> None:
    now = datetime(2026, 12, 5, 4, 0, tzinfo=UTC)
    beat = WatcherBeat(now - timedelta(seconds=BEAT_S + 20), "svc@ctl", 4242, 15.0)
    assert beat.alive(now)  # one beat late: a slow look, a late write
    assert beat.describe(now) == "last word 80 s ago (svc@ctl, pid 4242; it looks every 15 s)"
    stale = WatcherBeat(now - timedelta(seconds=2 * BEAT_S + 16), "svc@ctl", 4242, 15.0)
    assert not stale.alive(now)
