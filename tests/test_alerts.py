"""`vllm-redeploy alerts` on a real Prefect server: the automations it makes send through a real
notification block (Prefect's Custom Webhook) to a receiver on loopback, for a run that fails and
for a cluster still down after [alerts] unhealthy_for_s; a cluster back in time sends nothing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes
from tests.testbed.receiver import (
    Receiver,
    arm,
    ghost_cluster,
    post_event,
    receiving,
    webhook_block,
)
from vllm_redeploy.events import crashloop_event, unhealthy_event

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
UNHEALTHY_FOR_S = 10  # Prefect's minimum


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving("127.0.0.95") as server:
        yield server


def received(receiver: Receiver, text: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        found = [b for b in receiver.bodies if text in b["subject"] + b["body"]]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {text!r} within {seconds} s: {receiver.bodies}"
        time.sleep(0.25)


def cluster_file(tmp_path: Path, cluster: str, block: str) -> Path:
    """A cluster whose runs fail at preflight within seconds, alerting through ``block``."""
    alerts = f'[alerts]\nblock = "{block}"\nunhealthy_for_s = {UNHEALTHY_FOR_S}\n'
    return ghost_cluster(tmp_path / f"{cluster}.toml", cluster, "127.0.0.95", alerts)


def test_alerts_say_a_run_failed_and_a_cluster_still_down_and_nothing_when_it_came_back(
    prefect_api: str, receiver: Receiver, tmp_path: Path
) -> None:
    block = webhook_block(receiver)
    cluster = f"alerted{uuid.uuid4().hex[:6]}"
    path = cluster_file(tmp_path, cluster, block)
    cli = CliRunner(env={"PREFECT_API_URL": prefect_api})
    made = cli.invoke(app, ["alerts", "-c", str(path), "--json"])
    assert made.exit_code == 0, made.output
    names = json.loads(made.output)["alerts"]
    # No nightly deployment registered here: no alert for a nightly run that cannot be late.
    assert names == [f"vllm-redeploy alert: {cluster} {what}" for what in
                     ("failed", "crash-looping", "unhealthy")]  # fmt: skip
    again = cli.invoke(app, ["alerts", "-c", str(path), "--json"])  # replaces, never doubles
    assert again.exit_code == 0 and json.loads(again.output)["alerts"] == names
    resource = {"prefect.resource.id": f"vllm-redeploy.cluster.{cluster}"}
    try:
        arm(prefect_api, receiver, cluster)

        # Nobody reported it: nothing, for longer than Prefect's periodic pass takes to open a
        # window of its own and let it run out (its alert came within 20 s when it did).
        time.sleep(2 * UNHEALTHY_FOR_S + 5)
        assert not [b for b in receiver.bodies if "still down" in b["subject"]], receiver.bodies

        # Still down: the absence of vllm.cluster.ready after the watcher's report.
        report = unhealthy_event(cluster, ["the engine is not running"], datetime.now(UTC))
        post_event(prefect_api, report)
        down = received(receiver, f"{cluster} is still down", 60)
        # By the wall clock, as the server counts from the event's time (a clock the machine
        # may step meanwhile; the monotonic one once said 8.8 s).
        occurred = datetime.fromisoformat(report["occurred"])
        still_down_s = (datetime.now(UTC) - occurred).total_seconds()
        assert still_down_s >= UNHEALTHY_FOR_S - 1, still_down_s  # not before its time
        assert f"no run brought it back within {UNHEALTHY_FOR_S} s." in down["body"], down
        receiver.bodies.clear()

        # Crash-looping: the watcher's event, as it sends it.
        post_event(prefect_api, crashloop_event(cluster, 3, 3600, ["probe: empty answer"]))
        looping = received(receiver, f"{cluster} is crash-looping", 60)
        assert "3 recoveries in 3600" in looping["body"], looping
        assert "(last: probe: empty answer)" in looping["body"], looping
        receiver.bodies.clear()

        # Back in time (a run served it before unhealthy_for_s): no alert.
        since = datetime.now(UTC)
        post_event(prefect_api, unhealthy_event(cluster, ["the engine is not running"], since))
        post_event(
            prefect_api, {"event": "vllm.cluster.ready", "resource": resource, "payload": {}}
        )
        time.sleep(UNHEALTHY_FOR_S + 15)
        assert not [b for b in receiver.bodies if "still down" in b["subject"]], receiver.bodies

        # A real run that fails: the step, the reason, and the run.
        started = time.monotonic()
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
        assert state.is_failed()
        failed = received(receiver, f"{cluster}: a run failed at preflight", 60)
        failed_s = time.monotonic() - started
        assert "node ghost did not come back within 1 s" in failed["body"], failed
        # Its name; its page too where the server knows its UI's address (not this one).
        assert failed["body"].endswith(f"\nThe run: {cluster}-manual-redeploy"), failed
        keep_for_notes(
            "alerts",
            f"# a run failed ({failed_s:.1f} s from the run's start)\n\n{failed['subject']}\n\n"
            f"{failed['body']}\n\n# still down ({still_down_s:.1f} s after the report, "
            f"unhealthy_for_s = {UNHEALTHY_FOR_S})\n\n{down['subject']}\n\n{down['body']}\n",
        )
    finally:
        removed = cli.invoke(app, ["alerts", "-c", str(path), "--remove", "--json"])
    assert json.loads(removed.output)["removed"] == 3


def test_alerts_refuse_a_block_prefect_does_not_have(prefect_api: str, tmp_path: Path) -> None:
    path = cluster_file(tmp_path, "nowhere", "slack-webhook/no-such-block")
    done = CliRunner(env={"PREFECT_API_URL": prefect_api}).invoke(app, ["alerts", "-c", str(path)])
    assert done.exit_code == 2
    assert "Prefect has no block of type 'slack-webhook' named 'no-such-block'" in done.output


def test_the_nightly_alert_says_when_no_one_picked_the_nightly_run_up(
    prefect_api: str, receiver: Receiver, tmp_path: Path
) -> None:
    """The nightly deployment registered and nothing serving it (serve down): its run, due a
    minute ago, goes Late on the server, and the alert says so."""
    from prefect import get_client
    from prefect.states import Scheduled

    from deployments.definitions import deployment_specs
    from vllm_redeploy.config import load_config

    cluster = f"late{uuid.uuid4().hex[:6]}"
    path = cluster_file(tmp_path, cluster, webhook_block(receiver))
    config = load_config(path, env_file=None)
    (spec,) = [s for s in deployment_specs(config, path) if s["name"].endswith("-nightly")]
    spec["schedules"] = []  # its run is made below, already due
    deployment_id = redeploy_vllm_cluster.to_deployment(**spec).apply()
    cli = CliRunner(env={"PREFECT_API_URL": prefect_api})
    made = cli.invoke(app, ["alerts", "-c", str(path), "--json"])
    try:
        assert made.exit_code == 0, made.output
        assert (
            json.loads(made.output)["alerts"][-1] == f"vllm-redeploy alert: {cluster} nightly late"
        )
        arm(prefect_api, receiver, cluster)
        due = datetime.now(UTC) - timedelta(minutes=1)
        with get_client(sync_client=True) as client:
            run = client.create_flow_run_from_deployment(
                deployment_id, state=Scheduled(scheduled_time=due)
            )
        late = received(receiver, f"{cluster}: the nightly run did not start", 120)
        assert f"vllm-redeploy-serve@{cluster}" in late["body"], late
        assert late["body"].endswith(f"\nThe run: {run.name}"), late
    finally:
        cli.invoke(app, ["alerts", "-c", str(path), "--remove"])
        with get_client(sync_client=True) as client:
            client.delete_deployment(deployment_id)
