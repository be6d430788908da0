"""The watcher forwards the webhook's spool: each file is posted only as a reboot of its own
cluster, built again from its checked fields; anything else is set aside as .bad. And the whole
way: a signed notice to the webhook (no Prefect setting), the watcher's post, the event in a real
Prefect server."""

from __future__ import annotations

import json
import os
import secrets
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.cli.prefect_api import talking_to
from deployments.forwarder import Forwarder, NotAReboot, rebuilt
from deployments.spool import Spool, spool_of
from deployments.watcher import watch_clusters
from deployments.webhook import running_webhook
from tests.test_webhook import make_config, notice, signed, wait_for_event
from tests.testbed.procs import wait_until
from tests.testbed.receiver import ghost_cluster
from vllm_redeploy.config import load_config
from vllm_redeploy.events import cluster_rebooted_event, reboot_event, unhealthy_event

CONFIG = make_config("fw", None)


def spooled(spool: Path, event: dict[str, Any]) -> Path:
    path = spool / f"{uuid.uuid4()}.json"
    path.write_text(json.dumps(event))
    return path


def test_reboots_of_the_cluster_are_forwarded_as_the_webhook_wrote_them(tmp_path: Path) -> None:
    node = reboot_event("fw", "node-1", "b1", 42.5)
    round_ = cluster_rebooted_event("fw", {"node-1": "b1"}, ["node-2"], 3.0)
    for event in (node, round_):
        again = rebuilt(CONFIG, json.loads(json.dumps(event)))
        assert {k: again[k] for k in ("id", "event", "resource", "payload")} == {
            k: event[k] for k in ("id", "event", "resource", "payload")
        }


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (unhealthy_event("fw", ["x"], datetime.now(UTC)), "not a reboot"),
        (reboot_event("other", "node-1", "b1", 1.0), "not an event of cluster fw"),
        (reboot_event("fw", "node-9", "b1", 1.0), "is not a node of fw"),
        (reboot_event("fw", "node-1", "b" * 65, 1.0), "boot id"),
        (reboot_event("fw", "node-1", "b1", float("nan")), "uptime_s"),
        (cluster_rebooted_event("fw", {"node-9": "b"}, [], 1.0), "boots name no node"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_anything_else_is_refused(event: Any, why: str) -> None:
    with pytest.raises(NotAReboot, match=why):
        rebuilt(CONFIG, json.loads(json.dumps(event)))


def test_the_forwarder_hands_each_file_once_and_sets_aside_the_rest(tmp_path: Path) -> None:
    good = spooled(tmp_path, reboot_event("fw", "node-1", "b1", 1.0))
    bad = spooled(tmp_path, {"event": "prefect.flow-run.Completed", "resource": {}})
    handed: list[tuple[dict[str, Any], Path]] = []
    forwarder = Forwarder(CONFIG, tmp_path, lambda e, p: handed.append((e, p)) or True)
    assert forwarder.scan() == 1 and forwarder.scan() == 0  # once
    assert [p for _, p in handed] == [good]
    assert not bad.exists() and bad.with_suffix(".bad").exists()
    # Posted and removed, then the same boot accepted again (a webhook restarted meanwhile
    # forgot it): the same name, written anew, is handed again rather than left for good.
    written = good.stat().st_mtime_ns
    good.write_text(good.read_text())
    os.utime(good, ns=(written + 10**9, written + 10**9))
    assert forwarder.scan() == 1 and [p for _, p in handed] == [good, good]


@pytest.mark.integration
def test_the_watcher_posts_what_the_webhook_kept(prefect_api: str, tmp_path: Path) -> None:
    cluster, secret = f"fw{uuid.uuid4().hex[:6]}", secrets.token_hex(32)
    extra = f'[webhook]\nspool_dir = "{tmp_path / "spool"}"\n'
    extra += f'[secrets]\nwebhook_secret = "{secret}"\n'
    config = load_config(ghost_cluster(tmp_path / "c.toml", cluster, "127.0.0.95", extra))
    spool = Spool(spool_of(config).parent, [cluster])
    stop = threading.Event()
    watcher = threading.Thread(target=watch_clusters, args=([config], stop), daemon=True)
    with running_webhook(config, spool) as url:
        body, headers = signed(secret, notice("ghost"))
        answer = httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)
        assert answer.status_code == 202, answer.text
        # Kept, the node's and the round's (its only node is back): the webhook posts nothing.
        assert spool.pending == 2
        with talking_to({"PREFECT_API_URL": prefect_api}):  # the watcher's thread too
            watcher.start()
        try:
            event = wait_for_event(prefect_api, cluster, answer.json()["event_id"])
            wait_until(lambda: spool.pending == 0, 30, "the round's event posted too")
        finally:
            stop.set()
            watcher.join(60)
    assert event["resource"]["vllm-redeploy.node"] == "ghost"
    assert spool.pending == 0 and list(spool_of(config).iterdir()) == []
