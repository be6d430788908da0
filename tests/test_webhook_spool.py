"""Accepted notices are neither repeated nor lost: a captured notice replayed many times is
queued once, and what the webhook accepted while nothing could post it survives its restart and
is posted by the watcher's forwarder once Prefect answers (`serve_webhook` in its own process,
with no Prefect setting at all, its spool in the default place under $XDG_STATE_HOME)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.event_sender import EVENT_REBOOTED, EventSender, Refusal, reboot_event_id
from deployments.forwarder import Forwarder
from deployments.webhook import SECRET_ENV, running_webhook
from tests.test_webhook import make_config, notice, prefect_events, signed, wait_for_event
from tests.test_webhook_fuzz import stored_ids
from tests.testbed.procs import free_port
from vllm_redeploy.config import ClusterConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
NODES = ("node-1", "node-2", "node-3")  # node-3 never reports: no cluster event
SERVE = """
import os, sys
from deployments.webhook import serve_webhook
from tests.test_webhook import make_config
name, port = sys.argv[1], int(sys.argv[2])
config = make_config(name, os.environ[sys.argv[3]], tuple(sys.argv[4:]), reboot_delay_s=3600)
serve_webhook(config, "127.0.0.1", port)
"""


@contextlib.contextmanager
def webhook_process(
    cluster: str,
    secret: str,
    log: Path,
    state_dir: Path,
    open_files: int | None = None,
) -> Iterator[str]:
    """`serve_webhook` of ``cluster`` in its own process, as `vllm-redeploy webhook` runs it:
    no Prefect setting at all, $XDG_STATE_HOME ``state_dir`` (its spool under it), optionally
    under an open-file limit (soft and hard); its output appended to ``log``. Stopped with
    SIGTERM."""
    port = free_port("127.0.0.1")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        SECRET_ENV: secret,
        "XDG_STATE_HOME": str(state_dir),
        "PYTHONPATH": str(ROOT),
    }

    def limit() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, cluster, str(port), SECRET_ENV, *NODES],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,  # only setrlimit, before exec
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the webhook did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def spool_base(state_dir: Path) -> Path:
    """Where ``webhook_process`` keeps its spool: the default under $XDG_STATE_HOME."""
    return state_dir / "vllm-redeploy" / "webhook-spool"


@contextlib.contextmanager
def forwarding(config: ClusterConfig, base: Path, api: str) -> Iterator[EventSender]:
    """The watcher's part: the cluster's spool under ``base`` posted to ``api``."""
    sender = EventSender(api, min_backoff_s=0.2, max_backoff_s=1.0)
    stop = threading.Event()
    forwarder = Forwarder(config, base / config.name, sender.adopt)
    thread = threading.Thread(target=forwarder.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield sender
    finally:
        stop.set()
        thread.join(10)
        sender.close(timeout=10)


class CountingSender(EventSender):
    """The real sender, counting what the app submits per event id."""

    def __init__(self, api_url: str, **options: Any) -> None:
        super().__init__(api_url, **options)
        self.submitted: dict[str, int] = {}

    def offer(self, event: dict[str, Any]) -> Refusal | None:
        self.submitted[event["id"]] = self.submitted.get(event["id"], 0) + 1
        return super().offer(event)


async def replay(url: str, body: bytes, headers: dict[str, str], times: int) -> list[Any]:
    """The same captured request ``times`` times, 50 at once."""
    limits = httpx.Limits(max_connections=50, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        answers = await asyncio.gather(
            *(client.post("/reboot", content=body, headers=headers) for _ in range(times))
        )
    return [(a.status_code, a.json().get("event_id")) for a in answers]


@pytest.mark.timeout(120)
def test_a_notice_replayed_1000_times_is_queued_once(prefect_api: str) -> None:
    secret = secrets.token_hex(32)
    config = make_config(f"whrp{uuid.uuid4().hex[:8]}", secret, NODES, reboot_delay_s=3600)
    # A queue of 100: replays queued each time would fill it and refuse the genuine notice.
    sender = CountingSender(prefect_api, max_queue=100)
    try:
        with running_webhook(config, sender) as url:
            captured = notice("node-1")
            body, headers = signed(secret, captured)
            replayed_id = reboot_event_id(config.name, "node-1", captured["boot_id"])
            answers = asyncio.run(replay(url, body, headers, 1000))
            other = notice("node-2")
            body, headers = signed(secret, other)
            response = httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)
            assert response.status_code == 202, response.text
            other_id = response.json()["event_id"]
            wait_for_event(prefect_api, config.name, other_id)
    finally:
        assert sender.close(timeout=10)
    assert answers == [(202, replayed_id)] * 1000  # answered alike, as a notifier's retry is
    assert sender.submitted == {replayed_id: 1, other_id: 1}
    stored = [e["id"] for e in prefect_events(prefect_api, config.name)]
    assert sorted(stored) == sorted([replayed_id, other_id])


@pytest.mark.timeout(180)
def test_notices_accepted_while_prefect_is_down_survive_a_restart(
    prefect_api: str, tmp_path: Path
) -> None:
    secret, cluster = secrets.token_hex(32), f"whsp{uuid.uuid4().hex[:8]}"
    config = make_config(cluster, secret, NODES, reboot_delay_s=3600)
    log = tmp_path / "webhook.log"
    down = f"http://127.0.0.1:{free_port('127.0.0.1')}/api"  # nothing listens there
    base = spool_base(tmp_path)
    spool = base / cluster
    ids = []
    with webhook_process(cluster, secret, log, tmp_path) as url, forwarding(config, base, down):
        for i in range(30):
            body, headers = signed(secret, notice(NODES[i % 2]))
            response = httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)
            assert response.status_code == 202, response.text
            ids.append(response.json()["event_id"])
        health = httpx.get(f"{url}/healthz", timeout=10).json()
    assert health["pending_events"] == 30  # none posted: Prefect is away
    # Both stopped with Prefect still unreachable: all 30 still on disk.
    assert sorted(p.stem for p in spool.glob("*.json")) == sorted(ids), log.read_text()[-3000:]
    with webhook_process(cluster, secret, log, tmp_path), forwarding(config, base, prefect_api):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if set(stored_ids(prefect_api, cluster)) == set(ids) and not list(spool.iterdir()):
                break
            time.sleep(0.5)
    stored = stored_ids(prefect_api, cluster)
    assert sorted(stored) == sorted(ids), log.read_text()[-3000:]
    assert list(spool.iterdir()) == []  # nothing left behind, no temporary file either
    # Beside them, the reboot round (node-3 never reported): it outlives the restarts too.
    (state,) = base.glob(f"round-{cluster}.state")
    assert json.loads(state.read_text())["round"].keys() == {"node-1", "node-2"}
    kinds = {e["event"] for e in prefect_events(prefect_api, cluster)}
    assert kinds == {EVENT_REBOOTED}
