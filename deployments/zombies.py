"""Runs whose controller died (power cut, OOM-killed, SIGKILL) must not stay Running forever:
with one run at a time per deployment, such a run would hold back every later one, the nightly
redeploy and the after-reboot recovery included. Flow runs started by `serve` send a heartbeat;
this automation marks a run Crashed when its heartbeats stop, which frees the slot."""

from __future__ import annotations

import os
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

AUTOMATION_NAME = "vllm-redeploy: crash runs whose controller died"
HEARTBEAT_S = 30  # Prefect's minimum
SILENCE_S = 120  # four missed heartbeats: a busy controller is not a dead one


def enable_heartbeats() -> None:
    """Flow runs started from this process (and its children) send heartbeats."""
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))


def zombie_automation(name: str = AUTOMATION_NAME, silence_s: float = SILENCE_S) -> Automation:
    return Automation(
        name=name,
        description="Marks a flow run Crashed when its heartbeats stop (see vllm-redeploy docs).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {silence_s:g} s: the process running it died",
            )
        ],
    )


def ensure_zombie_automation(silence_s: float = SILENCE_S) -> bool:
    """Create the automation unless one of that name exists, or lengthen its silence to
    ``silence_s``; True when it was created. ``serve`` passes the longest ``[lock] lease_s`` of
    its clusters: heartbeats held back by a Prefect outage (or a stalled controller) arrive late,
    and a run marked Crashed meanwhile still runs. The cluster's lock never takes the cluster
    from such a run while it beats (tasks/standing/lock.py); the automation, which cannot read
    that beat, stays quiet at least as long, so the UI does not call a live run dead."""
    try:
        automation = Automation.read(name=AUTOMATION_NAME)
    except ValueError:
        zombie_automation(silence_s=silence_s).create()
        return True
    trigger = automation.trigger
    if isinstance(trigger, EventTrigger) and trigger.within.total_seconds() < silence_s:
        wanted = zombie_automation(silence_s=silence_s)
        automation.trigger, automation.actions = wanted.trigger, wanted.actions
        automation.update()
    return False
