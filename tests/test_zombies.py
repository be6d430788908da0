"""A run whose controller died is marked Crashed by the automation `serve` installs, against
the session's real Prefect server."""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
from prefect import flow
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.events import emit_event
from prefect.states import Running

from deployments.zombies import (
    AUTOMATION_NAME,
    SILENCE_S,
    ensure_zombie_automation,
    zombie_automation,
)

pytestmark = pytest.mark.integration


@flow(name="zombie-stand-in")
def _never_run() -> None:
    """Only its flow runs are used: created through the API, never executed."""


def test_serve_installs_the_automation_once(prefect_api: str) -> None:
    with contextlib.suppress(ValueError):  # `serve` in another test may have installed it
        Automation.read(name=AUTOMATION_NAME).delete()
    created = [ensure_zombie_automation(), ensure_zombie_automation()]
    assert created == [True, False]
    automation = Automation.read(name=AUTOMATION_NAME)
    assert automation.actions[0].state.value == "CRASHED"
    assert automation.trigger.within.total_seconds() == SILENCE_S


def test_serve_keeps_it_quiet_as_long_as_the_longest_lease(prefect_api: str) -> None:
    """A live run's heartbeats held back longer than its cluster's lease_s: it is the lock's
    to judge (by its beat), and the automation does not call the run dead before it could."""
    ensure_zombie_automation()
    try:
        assert ensure_zombie_automation(300) is False
        automation = Automation.read(name=AUTOMATION_NAME)
        assert automation.trigger.within.total_seconds() == 300
        assert "no heartbeat for 300 s" in (automation.actions[0].message or "")
        ensure_zombie_automation()  # another serve, with the default lease: never shortened
        assert Automation.read(name=AUTOMATION_NAME).trigger.within.total_seconds() == 300
    finally:  # the other tests of this server expect the default
        Automation.read(name=AUTOMATION_NAME).delete()
        ensure_zombie_automation()


def test_a_run_whose_heartbeats_stop_is_marked_crashed(prefect_api: str) -> None:
    name = f"zombies-{uuid.uuid4().hex[:8]}"
    zombie_automation(name=name, silence_s=10).create()
    try:
        with get_client(sync_client=True) as client:
            run = client.create_flow_run(_never_run)
            client.set_flow_run_state(run.id, Running(), force=True)
        time.sleep(2)  # let the server load the new automation before the heartbeat arrives
        emit_event(
            "prefect.flow-run.heartbeat",
            resource={"prefect.resource.id": f"prefect.flow-run.{run.id}"},
        )
        deadline = time.monotonic() + 90
        state = None
        while time.monotonic() < deadline:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(run.id).state
            if state is not None and state.is_crashed():
                break
            time.sleep(1)
        assert state is not None and state.is_crashed(), f"still {state} after 90 s"
        assert "no heartbeat for 10 s" in (state.message or "")
    finally:
        Automation.read(name=name).delete()
