"""The webhook's log filter: a warning a stranger can repeat at will (accept() out of files, a
refused call, a slow client cut off) is logged a few times a minute, then counted."""

from __future__ import annotations

import logging

from deployments.webhook import FloodFilter


def test_the_flood_filter_counts_what_it_holds_back() -> None:
    now = [0.0]
    flood = FloodFilter(burst=3, interval_s=60, clock=lambda: now[0])
    shown: list[str] = []

    def passes(msg: str, key: str | None = None, level: int = logging.WARNING) -> bool:
        record = logging.LogRecord("vllm_redeploy.webhook", level, __file__, 1, msg, (), None)
        if key is not None:
            record.flood_key = key
        if not flood.filter(record):
            return False
        shown.append(record.getMessage())
        return True

    emfile = "socket.accept() out of system resource\nsocket: <fd=6>"
    assert [passes(emfile) for _ in range(1000)] == [True] * 3 + [False] * 997
    assert passes("another warning")  # each kind has its own budget
    assert all(passes("refused a call", "refused 401") for _ in range(3))
    assert not passes("refused a call, worded otherwise", "refused 401")  # one kind: its key
    assert all(passes("an info line", level=logging.INFO) for _ in range(10))  # not limited
    now[0] = 61
    assert passes(emfile)
    assert shown[-1] == emfile + " (997 more like this suppressed)"
    assert passes(emfile)
    assert shown[-1] == emfile
