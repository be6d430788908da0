"""Every event this project emits, built in one place, so automations can match them all alike.

Each event's resource carries the label ``vllm-redeploy.cluster`` (and ``vllm-redeploy.node`` for a
node's events): an automation matches one cluster's reboots, failures and recoveries the same way.

- ``vllm.node.rebooted`` (the webhook, from a node's notifier): resource
  ``vllm-redeploy.node.<cluster>.<node>``; its id derives from cluster, node and boot id, so a
  notifier that retries the same boot yields one event (Prefect drops an id it has seen).
- ``vllm.cluster.rebooted`` (the webhook, once every node of the cluster reported its new boot,
  or ``reboot_delay_s`` after the first did): resource ``vllm-redeploy.cluster.<cluster>``; the
  after-reboot deployment runs on it.
- ``vllm.cluster.ready`` / ``vllm.cluster.failed`` (the end of every run): resource
  ``vllm-redeploy.cluster.<cluster>``.
- ``vllm.cluster.unhealthy`` (the watcher, after [watch] failures bad looks in a row) and
  ``vllm.cluster.crashloop`` (a recovery run past [watch] max_recoveries): the same resource.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from vllm_redeploy import PROJECT
from vllm_redeploy.names import cluster_resource_id

EVENT_REBOOTED = "vllm.node.rebooted"
EVENT_CLUSTER_REBOOTED = "vllm.cluster.rebooted"
EVENT_READY = "vllm.cluster.ready"
EVENT_FAILED = "vllm.cluster.failed"
EVENT_UNHEALTHY = "vllm.cluster.unhealthy"
EVENT_CRASHLOOP = "vllm.cluster.crashloop"
# Fixed for the life of the project: changing it changes every event id.
EVENT_NAMESPACE = uuid.UUID("d804102c-4dc8-43d6-90c1-37516ff2ad60")
RESOURCE_LABEL_CLUSTER = f"{PROJECT}.cluster"  # in events: the cluster a resource belongs to
LABEL_NODE = f"{PROJECT}.node"
REASON_CHARS = 2000


def node_resource_id(cluster: str, node: str) -> str:
    """The ``prefect.resource.id`` of a node, e.g. ``vllm-redeploy.node.bed.node-1``."""
    return f"{PROJECT}.node.{cluster}.{node}"


def cluster_resource(cluster: str) -> dict[str, str]:
    """The resource of a cluster's own events."""
    return {
        "prefect.resource.id": cluster_resource_id(cluster),
        "prefect.resource.name": cluster,
        RESOURCE_LABEL_CLUSTER: cluster,
    }


def reboot_event_id(cluster: str, node: str, boot_id: str) -> str:
    """The same boot of the same node always gives the same event id."""
    return str(uuid.uuid5(EVENT_NAMESPACE, f"{cluster}/{node}/{boot_id}"))


def reboot_event(cluster: str, node: str, boot_id: str, uptime_s: float) -> dict[str, Any]:
    """A Prefect event saying that ``node`` of ``cluster`` booted (``boot_id``)."""
    return {
        "id": reboot_event_id(cluster, node, boot_id),
        "event": EVENT_REBOOTED,
        "occurred": datetime.now(UTC).isoformat(),
        "resource": {
            "prefect.resource.id": node_resource_id(cluster, node),
            "prefect.resource.name": node,
            RESOURCE_LABEL_CLUSTER: cluster,
            LABEL_NODE: node,
        },
        "payload": {"boot_id": boot_id, "uptime_s": uptime_s},
    }


def cluster_rebooted_event(
    cluster: str, boots: dict[str, str], missing: list[str], waited_s: float
) -> dict[str, Any]:
    """The cluster's nodes came back: ``boots`` (node -> boot id) reported, ``missing`` did not
    within the wait. Its id derives from the boots, so two webhooks that saw the same ones give
    one event."""
    seen = ",".join(f"{node}/{boot}" for node, boot in sorted(boots.items()))
    return {
        "id": str(uuid.uuid5(EVENT_NAMESPACE, f"{cluster}/rebooted/{seen}")),
        "event": EVENT_CLUSTER_REBOOTED,
        "occurred": datetime.now(UTC).isoformat(),
        "resource": cluster_resource(cluster),
        "payload": {"boots": boots, "missing": missing, "waited_s": round(waited_s, 2)},
    }


def ready_event(
    cluster: str,
    mode: str,
    action: str,
    steps: dict[str, float],
    transport: dict[str, Any] | None = None,
    probe_s: float | None = None,
    weights: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """Arguments of ``prefect.events.emit_event`` for a run that ended with the model serving;
    ``transport``: what NCCL used between the nodes, per node (``TransportVerdict.as_dict``);
    ``probe_s``: how long the probe's answer took; ``weights``: the loader that read the
    weights and vLLM's own time for it, when this run loaded them."""
    payload: dict[str, Any] = {"mode": mode, "action": action, "steps": steps}
    if transport is not None:
        payload["transport"] = transport
    if probe_s is not None:
        payload["probe_s"] = round(probe_s, 3)
    if weights is not None:
        payload["loader"], payload["weights_s"] = weights[0], round(weights[1], 2)
    return {"event": EVENT_READY, "resource": cluster_resource(cluster), "payload": payload}


def failed_event(cluster: str, step: str, reason: str) -> dict[str, Any]:
    """Arguments of ``prefect.events.emit_event`` for a run that failed at ``step``."""
    return {
        "event": EVENT_FAILED,
        "resource": cluster_resource(cluster),
        "payload": {"step": step, "reason": reason[:REASON_CHARS]},
    }


def unhealthy_event(cluster: str, problems: list[str], since: datetime) -> dict[str, Any]:
    """The watcher's word that ``cluster`` has been unhealthy since ``since``; its id derives
    from the cluster and that moment, so a watcher that repeats itself makes one event."""
    return {
        "id": str(uuid.uuid5(EVENT_NAMESPACE, f"{cluster}/unhealthy/{since.isoformat()}")),
        "event": EVENT_UNHEALTHY,
        "occurred": datetime.now(UTC).isoformat(),
        "resource": cluster_resource(cluster),
        "payload": {
            "problems": [p[:REASON_CHARS] for p in problems],
            "since": since.isoformat(),
        },
    }


def crashloop_event(
    cluster: str, recoveries: int, window_s: float, reasons: list[str]
) -> dict[str, Any]:
    """Arguments of ``emit_event``: ``cluster`` crash-loops; no automatic run touches it now."""
    return {
        "event": EVENT_CRASHLOOP,
        "resource": cluster_resource(cluster),
        "payload": {
            "recoveries": recoveries,
            "window_s": window_s,
            "reasons": [r[:REASON_CHARS] for r in reasons],
        },
    }
