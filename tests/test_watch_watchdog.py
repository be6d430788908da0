"""Every read of a watcher's look has its own deadline; a look that still outlasts its limit is
said, with where it waits, and the next look waits for it rather than overlapping it."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from deployments import watcher as watcher_module
from tests.test_webhook import make_config


def test_a_look_past_its_limit_is_said_with_where_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(watcher_module, "look_limit_s", lambda config: 0.2)
    release = threading.Event()

    def stuck_in_a_read() -> None:
        release.wait(5)

    stuck = SimpleNamespace(config=make_config("wd", None), look_once=stuck_in_a_read)
    done = threading.Event()

    def watch() -> None:
        watcher_module._look_watched(stuck, threading.Event())  # type: ignore[arg-type]
        done.set()

    with caplog.at_level(logging.WARNING, logger="vllm_redeploy.watch"):
        threading.Thread(target=watch, daemon=True).start()
        time.sleep(0.7)
        assert not done.is_set()  # no second look while the first one runs
        release.set()
        assert done.wait(5)
    said = [r.getMessage() for r in caplog.records]
    assert said and all("wd: a look has taken more than 0 s" in m for m in said), said
    assert "stuck_in_a_read (test_watch_watchdog.py:" in said[0]  # where it waits
    assert "release.wait(5)" in said[0]
