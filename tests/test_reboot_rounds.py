"""When a cluster counts as back from a reboot (deployments/reboot_rounds.py): at once when every
node reported its new boot, else reboot_delay_s after the first report; a boot counts once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from deployments import reboot_rounds
from deployments.reboot_rounds import RebootRounds
from tests.test_webhook import make_config
from vllm_redeploy.events import EVENT_CLUSTER_REBOOTED


class Sent(list[dict[str, Any]]):
    def submit(self, event: dict[str, Any]) -> bool:
        self.append(event)
        return True


def rounds(delay_s: float) -> tuple[RebootRounds, Sent]:
    sent = Sent()
    config = make_config("rr", None, reboot_delay_s=delay_s)
    return RebootRounds(config, sent.submit), sent


def test_every_node_reported_starts_it_at_once_however_long_the_delay() -> None:
    r, sent = rounds(3600)
    r.reported("node-1", "b1")
    assert sent == []  # node-2 has not reported: wait for it
    r.reported("node-2", "b2")
    (event,) = sent  # no waiting: the event was handed over inside the call
    assert event["event"] == EVENT_CLUSTER_REBOOTED
    assert event["resource"]["vllm-redeploy.cluster"] == "rr"
    assert event["payload"]["boots"] == {"node-1": "b1", "node-2": "b2"}
    assert event["payload"]["missing"] == []
    r.close()


def test_a_node_that_never_reports_is_waited_for_only_the_delay() -> None:
    r, sent = rounds(0.5)
    r.reported("node-1", "b1")
    assert sent == []
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = sent
    assert event["payload"]["missing"] == ["node-2"]
    assert event["payload"]["waited_s"] >= 0.5
    r.reported("node-2", "b2")  # late: a round of its own, closed by its own delay
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sent[1]["payload"]["boots"] == {"node-2": "b2"}
    assert sent[1]["payload"]["missing"] == ["node-1"]
    r.close()


def test_a_retried_boot_counts_once_and_a_new_boot_opens_a_round() -> None:
    r, sent = rounds(3600)
    r.reported("node-1", "b1")
    r.reported("node-1", "b1")  # the notifier retrying
    r.reported("node-2", "b2")
    r.reported("node-2", "b2")  # after the round: still the same boot
    assert len(sent) == 1
    r.reported("node-1", "b3")  # node-1 rebooted again
    r.reported("node-2", "b4")
    assert [e["payload"]["boots"] for e in sent] == [
        {"node-1": "b1", "node-2": "b2"},
        {"node-1": "b3", "node-2": "b4"},
    ]
    assert sent[0]["id"] != sent[1]["id"]
    r.close()


def test_a_closed_webhook_emits_nothing_for_its_open_round() -> None:
    r, sent = rounds(0.2)
    r.reported("node-1", "b1")
    r.close()
    time.sleep(0.5)
    assert sent == []


def test_a_round_outlives_a_restart_of_the_webhook(tmp_path: Path) -> None:
    state = tmp_path / "round-rr.state"
    config = make_config("rr", None, reboot_delay_s=3600)
    before = Sent()
    first = RebootRounds(config, before.submit, state)
    first.reported("node-1", "b1")
    first.close()  # restarted mid-round (an upgrade, a crash)
    after = Sent()
    second = RebootRounds(config, after.submit, state)
    second.reported("node-1", "b1")  # the notifier retrying the same boot: counted already
    assert after == []
    second.reported("node-2", "b2")
    (event,) = after
    assert event["payload"]["boots"] == {"node-1": "b1", "node-2": "b2"}
    assert before == []
    second.close()


def test_a_round_a_restart_interrupted_closes_when_it_would_have(tmp_path: Path) -> None:
    state = tmp_path / "round-rr.state"
    config = make_config("rr", None, reboot_delay_s=1.0)
    first = RebootRounds(config, Sent().submit, state)
    first.reported("node-1", "b1")
    first.close()
    after = Sent()
    second = RebootRounds(config, after.submit, state)  # no report to it
    deadline = time.monotonic() + 10
    while not after and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = after
    assert event["payload"]["missing"] == ["node-2"]
    assert 1.0 <= event["payload"]["waited_s"] < 5
    second.close()


def test_a_cluster_event_the_sender_cannot_take_is_offered_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its disk full, the spool refuses it; the event is what starts the after-reboot run."""
    monkeypatch.setattr(reboot_rounds, "RETRY_S", 0.2)
    offered: list[dict[str, Any]] = []

    def full_then_free(event: dict[str, Any]) -> bool:
        offered.append(event)
        return len(offered) >= 3

    r = RebootRounds(make_config("rr", None, reboot_delay_s=3600), full_then_free)
    r.reported("node-1", "b1")
    r.reported("node-2", "b2")
    deadline = time.monotonic() + 10
    while len(offered) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(offered) == 3 and offered[0] == offered[2]  # taken the third time, then no more
    r.close()
