"""When a cluster counts as back from a reboot (deployments/reboot_rounds.py): at once when every
node reported its new boot, else reboot_delay_s after the first report; a boot counts once."""

from __future__ import annotations

import time
from typing import Any

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
