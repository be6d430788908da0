"""`vllm-redeploy alerts`: a message when a night goes wrong, as Prefect automations that send
through one of Prefect's notification blocks (Slack, Teams, email, a custom webhook: made in
the UI or with `prefect block create`, so their secrets stay in Prefect, never in our file).

Per cluster, from ``[alerts]``:
- a run failed (``vllm.cluster.failed``): the step, its one-line reason, the run's page;
- the cluster was marked crash-looping (``vllm.cluster.crashloop``);
- the watcher reported it unhealthy and no run brought it back (``vllm.cluster.ready``) within
  ``unhealthy_for_s``: a proactive trigger, the absence of the good news;
- the nightly run is late (``prefect.flow-run.Late`` of the nightly deployment): its time came
  and nothing picked it up (the serve process down, the controller off).

Each automation is named after the cluster and what it alerts on; setting them up again
replaces them, so the command is safe to repeat after a change of the file.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from prefect.automations import Automation
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.events import EVENT_CRASHLOOP, EVENT_FAILED, EVENT_READY, EVENT_UNHEALTHY
from vllm_redeploy.names import deployment_name
from vllm_redeploy.status import duration

PREFIX = "vllm-redeploy alert"
# The run's name, and its page when the server knows its UI's address (PREFECT_UI_URL).
LINK = (
    "{% if flow_run %}\nThe run: {{ flow_run.name }}{% set page = flow_run|ui_url %}"
    "{% if page %}, {{ page }}{% endif %}{% endif %}"
)


class AlertsProblem(Exception):
    """Why the alerts cannot be set up, in words, with the fix."""


def automation_name(cluster: str, what: str) -> str:
    return f"{PREFIX}: {cluster} {what}"


def alert_automations(
    config: ClusterConfig, block_id: UUID, nightly_id: UUID | None
) -> list[Automation]:
    """The cluster's alerts, sending through the block ``block_id``; the nightly one only when
    the nightly deployment (``nightly_id``) is registered."""
    cluster = config.name
    match = ResourceSpecification({"prefect.resource.id": f"vllm-redeploy.cluster.{cluster}"})
    patience = duration(config.alerts.unhealthy_for_s)

    def alert(what: str, about: str, trigger: EventTrigger, subject: str, body: str) -> Automation:
        return Automation(
            name=automation_name(cluster, what),
            description=about,
            trigger=trigger,
            actions=[SendNotification(block_document_id=block_id, subject=subject, body=body)],
        )

    def on(event: str) -> EventTrigger:
        return EventTrigger(expect={event}, match=match, posture=Posture.Reactive, threshold=1)

    found = [
        alert(
            "failed",
            f"A run of {cluster} failed: the step, why, and the run.",
            on(EVENT_FAILED),
            f"{cluster}: a run failed at {{{{ event.payload.step }}}}",
            f"{cluster}: a run failed at {{{{ event.payload.step }}}}: "
            f"{{{{ event.payload.reason }}}}{LINK}",
        ),
        alert(
            "crash-looping",
            f"{cluster} was marked crash-looping: nothing automatic touches it now.",
            on(EVENT_CRASHLOOP),
            f"{cluster} is crash-looping",
            f"{cluster} is crash-looping: {{{{ event.payload.recoveries }}}} recoveries in "
            f"{{{{ event.payload.window_s }}}} s did not keep it up (last: {{{{ "
            "event.payload.reasons | last }}). No automatic run touches it until "
            "`vllm-redeploy resume` or a manual run that serves.",
        ),
        alert(
            "unhealthy",
            f"{cluster} was reported unhealthy and not back within {patience}.",
            EventTrigger(
                after={EVENT_UNHEALTHY},
                expect={EVENT_READY},
                match=match,
                # A window per cluster, opened only by its report: without for_each, Prefect's
                # periodic pass opens one on its own and the alert fires for a cluster nobody
                # reported (seen: "still down" every few passes for a healthy one).
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=config.alerts.unhealthy_for_s),
            ),
            f"{cluster} is still down",
            f"{cluster} was reported unhealthy and no run brought it back within {patience}. "
            "`vllm-redeploy status` says what is wrong, `vllm-redeploy runs` what the recoveries "
            "did.",
        ),
    ]
    if nightly_id is not None:
        late = EventTrigger(
            expect={"prefect.flow-run.Late"},
            match_related=ResourceSpecification(
                {"prefect.resource.id": f"prefect.deployment.{nightly_id}"}
            ),
            posture=Posture.Reactive,
            threshold=1,
        )
        found.append(
            alert(
                "nightly late",
                f"The nightly run of {cluster} is late: nothing picked it up.",
                late,
                f"{cluster}: the nightly run did not start",
                f"{cluster}: the nightly run did not start at its time: no serve process picked "
                f"it up (`sudo systemctl status vllm-redeploy-serve@{cluster}`; `vllm-redeploy "
                f"doctor`).{LINK}",
            )
        )
    return found


def set_up_alerts(config: ClusterConfig) -> list[Automation]:
    """Create (or replace) the cluster's alert automations; what was created."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    block = config.alerts.block
    if block is None:
        raise AlertsProblem(
            f"{config.name}: [alerts] block is not set: name the Prefect notification block "
            'the alerts go through, e.g. block = "slack-webhook/ops" (`prefect block ls` lists '
            "them; make one in the UI under Blocks)"
        )
    kind, _, name = block.partition("/")
    with get_client(sync_client=True) as client:
        try:
            document = client.read_block_document_by_name(name, kind)
        except ObjectNotFound:
            raise AlertsProblem(
                f"{config.name}: [alerts] block {block!r}: Prefect has no block of type "
                f"{kind!r} named {name!r}; `prefect block ls` lists those it has"
            ) from None
        if "notify" not in (document.block_schema.capabilities if document.block_schema else []):
            raise AlertsProblem(
                f"{config.name}: [alerts] block {block!r} cannot send notifications: name a "
                "notification block (Slack Webhook, Microsoft Teams, Email, Custom Webhook, ...)"
            )
        try:
            nightly = client.read_deployment_by_name(
                f"redeploy-vllm-cluster/{deployment_name(config.name, 'nightly')}"
            )
            nightly_id: UUID | None = nightly.id
        except ObjectNotFound:
            nightly_id = None
    wanted = alert_automations(config, document.id, nightly_id)
    remove_alerts(config)
    for automation in wanted:
        automation.create()
    return wanted


def remove_alerts(config: ClusterConfig) -> int:
    """Delete the cluster's alert automations; how many there were."""
    from prefect import get_client

    prefix = automation_name(config.name, "")
    with get_client(sync_client=True) as client:
        mine = [a for a in client.read_automations() if a.name.startswith(prefix)]
        for automation in mine:
            client.delete_automation(automation.id)
    return len(mine)
