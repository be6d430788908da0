"""The four deployments of the flow, in code: `vllm-redeploy serve` runs them from one process.

prefect.yaml declares the same four for `prefect deploy --all` with a work pool; a test keeps
the two in step.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect.events import DeploymentEventTrigger
from prefect.events.schemas.events import ResourceSpecification
from prefect.schedules import Cron
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from vllm_redeploy import PROJECT
from vllm_redeploy.config import CONFIG_VARIABLE, ClusterConfig
from vllm_redeploy.events import EVENT_CLUSTER_REBOOTED, EVENT_UNHEALTHY, RESOURCE_LABEL_CLUSTER
from vllm_redeploy.names import cluster_tag, deployment_name

# No deployment carries Prefect's own concurrency limit: the cluster's lock (tasks/standing/lock.py)
# already runs one run of the cluster at a time, whatever deployment or process started it, and
# never drops one. A deployment limit would add a lease that the flow's process must renew, and
# Prefect cancels a run whose renewal fails (a server restarted without its lease storage, an
# outage longer than the renewal's retries) in the middle of a load, past the flow's clean-up.


def reboot_trigger(config: ClusterConfig) -> DeploymentEventTrigger:
    """Fire at once when the webhook says the cluster is back (every node reported its new boot,
    or reboot_delay_s passed since the first did: deployments/reboot_rounds.py), then ignore more
    for the debounce window; the run's preflight waits for late nodes anyway."""
    return DeploymentEventTrigger(
        name=f"{config.name}: the nodes rebooted",
        expect={EVENT_CLUSTER_REBOOTED},
        match=ResourceSpecification({RESOURCE_LABEL_CLUSTER: config.name}),
        posture="Reactive",
        threshold=1,
        within=timedelta(seconds=config.webhook.reboot_debounce_s),
        parameters={"mode": "ensure", "trigger": "after-reboot"},
    )


def unhealthy_trigger(config: ClusterConfig) -> DeploymentEventTrigger:
    """Fire on the watcher's word that the cluster is unhealthy (`vllm-redeploy watch`); the
    run's guard paces recoveries and stops them when the cluster crash-loops."""
    return DeploymentEventTrigger(
        name=f"{config.name}: unhealthy",
        expect={EVENT_UNHEALTHY},
        match=ResourceSpecification({RESOURCE_LABEL_CLUSTER: config.name}),
        posture="Reactive",
        threshold=1,
        within=timedelta(seconds=0),
        parameters={"mode": "ensure", "trigger": "recover"},
    )


def nightly_schedules(config: ClusterConfig) -> list[Any]:
    """``[schedule]``: the nightly cron in its time zone (explicit: it must not move with the
    controller's locale); none when it is "off". `serve` replaces what the deployment had."""
    schedule = config.schedule
    if schedule.nightly == "off":
        return []
    return [Cron(schedule.nightly, timezone=schedule.timezone, slug="nightly")]


def schedule_problem(config: ClusterConfig) -> str | None:
    """Why Prefect would refuse ``[schedule] nightly`` (a value out of range: minute 61, ...)."""
    try:
        nightly_schedules(config)
    except ValueError as exc:
        return (
            f"schedule.nightly: {config.schedule.nightly!r} is not a cron line Prefect accepts "
            f'({exc}); e.g. "0 4 * * *", "30 2 * * 1-5"'
        )
    return None


def deployment_specs(config: ClusterConfig, config_path: Path) -> list[dict[str, Any]]:
    """Keyword arguments of ``flow.to_deployment`` for nightly, after-reboot, recover, manual.
    ``config_path`` is shown in the UI's form; a run that names another file is refused."""
    params = {"config_path": str(config_path.resolve())}
    tags = [PROJECT, cluster_tag(config.name)]
    return [
        {
            "name": deployment_name(config.name, "nightly"),
            "description": "Every night ([schedule] nightly): a full redeploy, so the cluster "
            "starts the day fresh.",
            "schedules": nightly_schedules(config),
            "parameters": {**params, "mode": "redeploy", "trigger": "nightly"},
            "tags": [*tags, "nightly"],
        },
        {
            "name": deployment_name(config.name, "after-reboot"),
            "description": "After a node reboots: bring the model back if it is not healthy.",
            "triggers": [reboot_trigger(config)],
            "parameters": {**params, "mode": "ensure", "trigger": "after-reboot"},
            "tags": [*tags, "after-reboot"],
        },
        {
            "name": deployment_name(config.name, "recover"),
            "description": "When the watcher finds the cluster unhealthy: bring it back, paced, "
            "and stop when it crash-loops.",
            "triggers": [unhealthy_trigger(config)],
            "parameters": {**params, "mode": "ensure", "trigger": "recover"},
            "tags": [*tags, "recover"],
        },
        {
            "name": deployment_name(config.name, "manual"),
            "description": "From the UI: pick the mode (ensure or redeploy) and run; "
            "override_pause runs even while the cluster is paused.",
            "parameters": {**params, "mode": "ensure", "trigger": "manual"},
            "tags": [*tags, "manual"],
        },
    ]


# How often `serve` asks the API for runs to start: a click in the UI or a reboot's run starts
# within this. Prefect's default, 10 s, would add up to 10 s to every recovery; one cheap query.
RUNNER_POLL_S = 2.0
# `serve` exits, stopping the runs it started, once three of its polls in a row fail; each poll's
# call is retried with backoff (2, 4, 8 ... s) this many times first. Prefect's 5 (62 s a call)
# let a server away for ~3 minutes end a load; 8 (510 s a call) keeps serve up through ~25.
SERVE_CLIENT_RETRIES = 8


def serve_deployments(clusters: list[tuple[ClusterConfig, Path]]) -> None:
    """Serve each cluster's deployments from this process (no work pool); each run loads its
    cluster's configuration from its own file, one of those this process serves: the runs
    inherit them as VLLM_REDEPLOY_CONFIG, and the flow refuses a ``config_path`` that names any
    other. Schedules stay active when it stops: a controller restart must not silently pause the
    nightly run."""
    from prefect import serve

    from deployments.zombies import SILENCE_S, enable_heartbeats, ensure_zombie_automation
    from flows.redeploy import redeploy_vllm_cluster
    from tasks.standing.lock import ensure_cluster_lock

    # What its runs may load (flows/redeploy.py): the files it was started with, as the
    # deployments name them, whatever VLLM_REDEPLOY_CONFIG said before.
    os.environ[CONFIG_VARIABLE] = os.pathsep.join(str(path.resolve()) for _, path in clusters)
    enable_heartbeats()
    ensure_zombie_automation(max([SILENCE_S, *(config.lock.lease_s for config, _ in clusters)]))
    for config, _ in clusters:
        ensure_cluster_lock(config.name)  # every run of the cluster takes it, from any deployment

    deployments = [
        redeploy_vllm_cluster.to_deployment(**spec)
        for config, config_path in clusters
        for spec in deployment_specs(config, config_path)
    ]
    retries = max(PREFECT_CLIENT_MAX_RETRIES.value(), SERVE_CLIENT_RETRIES)
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: retries}):
        serve(*deployments, pause_on_shutdown=False, query_seconds=RUNNER_POLL_S)
