"""A run's records (tasks/records.py) against the session's real Prefect server: a write never
holds up the step that asks for it, a key that could not be written keeps only its latest
value and is written once the API takes it, and what never gets written is named at the end."""

from __future__ import annotations

import threading

import pytest
from prefect import flow

from tasks.records import Recorder

pytestmark = pytest.mark.integration


class Api:
    """What the records are written to: refuses the first ``refusals`` writes, as an API that
    is away, then takes each value it is given."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.taken: list[tuple[str, int]] = []

    def write(self, key: str, value: int) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise ConnectionError("All connection attempts failed")
        self.taken.append((key, value))


@flow
def asks(api: Api, values: list[int], wait_s: float) -> list[str]:
    recorder = Recorder()
    for value in values:
        recorder.record("progress", lambda value=value: api.write("progress", value))
    recorder.record("summary", lambda: api.write("summary", 0))
    return recorder.flush(wait_s)


def test_while_the_api_is_away_a_key_keeps_its_latest_value_and_is_written_when_it_is_back(
    prefect_api: str,
) -> None:
    api = Api(refusals=2)
    assert asks(api, [10, 20, 30], wait_s=60) == []
    assert api.taken.count(("summary", 0)) == 1
    progress = [value for key, value in api.taken if key == "progress"]
    assert progress[-1] == 30 and len(progress) < 3  # what it missed is not replayed


def test_what_the_api_never_takes_is_named_at_the_end(prefect_api: str) -> None:
    api = Api(refusals=10_000)
    assert sorted(asks(api, [1], wait_s=2)) == ["progress", "summary"]
    assert api.taken == []


@flow
def asks_while_a_write_hangs() -> list[bool]:
    """The write waits until the step goes on; had ``record`` run it in the step, it would have
    waited the whole minute, and said so."""
    recorder, step_went_on, ended = Recorder(), threading.Event(), []
    recorder.record("hung", lambda: ended.append(step_went_on.wait(60)))
    recorder.record("next", lambda: None)
    step_went_on.set()
    assert recorder.flush(30) == []
    return ended


def test_a_write_that_hangs_holds_up_no_step(prefect_api: str) -> None:
    assert asks_while_a_write_hangs() == [True]
