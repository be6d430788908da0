"""The reboot webhook, served by a real uvicorn, sending real events to the session's Prefect
server; what Prefect recorded is read back through its API (POST /api/events/filter)."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from deployments.event_sender import (
    EVENT_REBOOTED,
    EventSender,
    node_resource_id,
    reboot_event_id,
)
from deployments.webhook import (
    SECRET_ENV,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    create_app,
    running_webhook,
    serve_webhook,
    sign,
)
from vllm_redeploy.config import ClusterConfig

pytestmark = pytest.mark.integration

NODES = ("node-1", "node-2")
EVENT_WAIT_S = 20  # Prefect's event persister flushes every 5 s by default


# --- helpers (test_notifier uses them too) ------------------------------------------------------


def make_config(
    name: str, secret: str | None, nodes: tuple[str, ...] = NODES, **webhook: Any
) -> ClusterConfig:
    return ClusterConfig(  # type: ignore[call-arg]
        _env_file=None,
        name=name,
        nodes=[{"name": n, "address": f"127.0.0.{201 + i}"} for i, n in enumerate(nodes)],
        vllm={"image": "vrd-test/none:1", "model": "/models/none"},
        webhook=webhook,
        secrets={"webhook_secret": secret} if secret else {},
    )


def signed(
    secret: str, payload: dict[str, Any] | bytes, timestamp: int | None = None
) -> tuple[bytes, dict[str, str]]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    ts = str(int(time.time()) if timestamp is None else timestamp)
    headers = {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: ts,
        SIGNATURE_HEADER: sign(secret, ts, body),
    }
    return body, headers


def notice(node: str = "node-1", boot_id: str | None = None, uptime_s: float = 42.5) -> dict:
    return {"node": node, "boot_id": boot_id or str(uuid.uuid4()), "uptime_s": uptime_s}


def prefect_events(api: str, cluster: str, node: str | None = None) -> list[dict[str, Any]]:
    """Reboot events Prefect has stored for ``cluster`` (or one of its nodes), newest first."""
    resource = (
        {"id": [node_resource_id(cluster, node)]}
        if node
        else {"id_prefix": [node_resource_id(cluster, "")]}
    )
    response = httpx.post(
        f"{api}/events/filter",
        json={"filter": {"event": {"name": [EVENT_REBOOTED]}, "resource": resource}, "limit": 50},
        timeout=10,
    )
    response.raise_for_status()
    return response.json()["events"]


def wait_for_event(api: str, cluster: str, event_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline:
        found = [e for e in prefect_events(api, cluster) if e["id"] == event_id]
        if found:
            return found[0]
        time.sleep(0.25)
    raise AssertionError(f"event {event_id} not in Prefect after {EVENT_WAIT_S} s")


# --- fixtures ---------------------------------------------------------------------------------


@dataclass
class Webhook:
    url: str
    config: ClusterConfig
    secret: str
    sender: EventSender
    api: str

    @property
    def cluster(self) -> str:
        return self.config.name

    def post(self, body: bytes | Any, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(f"{self.url}/reboot", content=body, headers=headers or {}, timeout=10)

    def send(self, payload: dict[str, Any] | bytes, **kw: Any) -> httpx.Response:
        return self.post(*signed(self.secret, payload, **kw))

    def sentinel(self) -> None:
        """A valid call after the ones under test; once Prefect has it, it has everything the
        webhook handed over before it (one sender, one ordered queue)."""
        response = self.send(notice())
        assert response.status_code == 202
        wait_for_event(self.api, self.cluster, response.json()["event_id"])


@pytest.fixture(scope="module")
def webhook(prefect_api: str) -> Iterator[Webhook]:
    secret = secrets.token_hex(32)
    # node-3 never reports and no test outlives the delay: the cluster's own event (once every
    # node reported, tests/test_reboot_rounds.py) stays out of the counts of events sent.
    config = make_config(
        f"wh{uuid.uuid4().hex[:8]}", secret, (*NODES, "node-3"), reboot_delay_s=3600
    )
    sender = EventSender(prefect_api)
    try:
        with running_webhook(config, sender) as url:
            yield Webhook(url, config, secret, sender, prefect_api)
    finally:
        assert sender.close(timeout=10)


# --- tests ------------------------------------------------------------------------------------


def test_signed_call_emits_one_event_with_the_node_as_resource(webhook: Webhook) -> None:
    boot_id = str(uuid.uuid4())
    response = webhook.send(notice("node-2", boot_id, 17.25))
    assert response.status_code == 202
    assert response.json() == {
        "accepted": True,
        "event_id": reboot_event_id(webhook.cluster, "node-2", boot_id),
    }
    event = wait_for_event(webhook.api, webhook.cluster, response.json()["event_id"])
    assert event["event"] == "vllm.node.rebooted"
    assert event["resource"] == {
        "prefect.resource.id": f"vllm-redeploy.node.{webhook.cluster}.node-2",
        "prefect.resource.name": "node-2",
        "vllm-redeploy.cluster": webhook.cluster,
        "vllm-redeploy.node": "node-2",
    }
    assert event["payload"] == {"boot_id": boot_id, "uptime_s": 17.25}
    assert [e["id"] for e in prefect_events(webhook.api, webhook.cluster, "node-2")].count(
        event["id"]
    ) == 1


def test_a_retried_boot_is_one_event(webhook: Webhook) -> None:
    boot_id = str(uuid.uuid4())
    ids = set()
    sent_before = webhook.sender.sent
    for uptime in (30.0, 31.0, 33.0):  # a notifier retrying: new signature and uptime each time
        response = webhook.send(notice("node-1", boot_id.upper(), uptime))
        assert response.status_code == 202
        ids.add(response.json()["event_id"])
    assert ids == {reboot_event_id(webhook.cluster, "node-1", boot_id)}
    webhook.sentinel()
    assert webhook.sender.sent - sent_before == 2  # the boot, queued once, and the sentinel
    stored = [e for e in prefect_events(webhook.api, webhook.cluster) if e["id"] in ids]
    assert len(stored) == 1
    assert stored[0]["payload"]["boot_id"] == boot_id  # canonical form


def _rejections(webhook: Webhook) -> list[tuple[str, int, Callable[[], httpx.Response], str]]:
    """(what, expected status, the call, its boot id) for every call that must emit nothing."""
    key, limit = webhook.secret, webhook.config.webhook.max_body_bytes
    boots = {name: str(uuid.uuid4()) for name in ("unsigned", "key", "tamper", "stale", "future")}
    boots.update({name: str(uuid.uuid4()) for name in ("big", "chunked", "badsig", "unknown")})

    def body(name: str, node: str = "node-1") -> bytes:
        return json.dumps(notice(node, boots[name])).encode()

    def tampered() -> httpx.Response:
        data, headers = signed(key, body("tamper"))
        return webhook.post(data.replace(b"42.5", b"99.5"), headers)

    def oversized(name: str, stream: bool) -> httpx.Response:
        padded = body(name)[:-1] + b" " * (limit + 10) + b"}"
        data, headers = signed(key, padded)
        if not stream:
            return webhook.post(data, headers)
        return webhook.post(iter([data[:1000], data[1000:3000], data[3000:]]), headers)

    now = int(time.time())
    window = int(webhook.config.webhook.replay_window_s)
    return [
        ("unsigned", 401, lambda: webhook.post(body("unsigned")), boots["unsigned"]),
        ("wrong key", 401, lambda: webhook.post(*signed("x" * 64, body("key"))), boots["key"]),
        ("tampered body", 401, tampered, boots["tamper"]),
        (
            "replayed (stale)",
            401,
            lambda: webhook.send(body("stale"), timestamp=now - window - 5),
            boots["stale"],
        ),
        (
            "from the future",
            401,
            lambda: webhook.send(body("future"), timestamp=now + window + 5),
            boots["future"],
        ),
        (
            "malformed signature",
            401,
            lambda: webhook.post(
                body("badsig"),
                {TIMESTAMP_HEADER: str(now), SIGNATURE_HEADER: "sha256=" + "zz" * 32},
            ),
            boots["badsig"],
        ),
        ("oversized", 413, lambda: oversized("big", stream=False), boots["big"]),
        ("oversized, chunked", 413, lambda: oversized("chunked", stream=True), boots["chunked"]),
        ("malformed JSON", 400, lambda: webhook.send(b'{"node": "node-1", '), ""),
        ("not an object", 400, lambda: webhook.send(b"[]"), ""),
        ("unknown node", 400, lambda: webhook.send(body("unknown", "node-9")), boots["unknown"]),
        ("bad boot id", 400, lambda: webhook.send(notice(boot_id="not-a-uuid")), ""),
        ("wrong type", 400, lambda: webhook.send({**notice(), "uptime_s": "42"}), ""),
        ("negative uptime", 400, lambda: webhook.send({**notice(), "uptime_s": -1}), ""),
        ("missing field", 400, lambda: webhook.send({"node": "node-1", "uptime_s": 1}), ""),
    ]


def test_refused_calls_answer_their_status_and_emit_nothing(webhook: Webhook) -> None:
    before = {e["id"] for e in prefect_events(webhook.api, webhook.cluster)}
    sent_before = webhook.sender.sent
    refused_boots = set()
    for what, status, call, boot_id in _rejections(webhook):
        response = call()
        assert response.status_code == status, (what, response.text)
        body = response.json()
        assert list(body) == ["error"] and len(response.content) < 250, (what, body)
        assert webhook.secret not in response.text and "sha256=" not in response.text
        refused_boots.add(boot_id)
    webhook.sentinel()
    assert webhook.sender.sent - sent_before == 1
    new = [e for e in prefect_events(webhook.api, webhook.cluster) if e["id"] not in before]
    assert len(new) == 1  # the sentinel only
    assert not refused_boots & {e["payload"]["boot_id"] for e in new}


def test_a_body_of_exactly_the_limit_is_accepted(webhook: Webhook) -> None:
    limit = webhook.config.webhook.max_body_bytes
    data = json.dumps(notice()).encode()
    data = data[:-1] + b" " * (limit - len(data)) + b"}"
    assert len(data) == limit
    assert webhook.post(*signed(webhook.secret, data)).status_code == 202


def test_healthz_and_no_docs_served(webhook: Webhook) -> None:
    response = httpx.get(f"{webhook.url}/healthz", timeout=5)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
    assert isinstance(response.json()["pending_events"], int)
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(f"{webhook.url}{path}", timeout=5).status_code == 404, path
    # The schema stays available to developers, from the app itself.
    spec = create_app(webhook.config, webhook.sender).openapi()
    post = spec["paths"]["/reboot"]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["node", "boot_id", "uptime_s"]
    assert schema["properties"]["boot_id"]["format"] == "uuid"
    assert {p["name"] for p in post["parameters"]} == {TIMESTAMP_HEADER, SIGNATURE_HEADER}
    assert {"202", "400", "401", "413"} <= set(post["responses"])


def test_no_secret_no_service() -> None:
    config = make_config("nosecret", None)
    with pytest.raises(ValueError, match=SECRET_ENV):
        serve_webhook(config, "127.0.0.1", 1)  # refuses before binding anything
    sender = EventSender("http://127.0.0.1:9/api")
    try:
        with pytest.raises(ValueError, match=SECRET_ENV):
            create_app(config, sender)
        with pytest.raises(ValueError, match="shorter than"):
            create_app(make_config("short", "tooshort"), sender)
    finally:
        sender.close(timeout=1)


def test_sender_keeps_events_while_prefect_is_down_and_never_blocks() -> None:
    sender = EventSender("http://127.0.0.1:9/api", min_backoff_s=0.05, max_backoff_s=0.1)
    started = time.monotonic()
    assert sender.submit({"id": str(uuid.uuid4())})
    assert time.monotonic() - started < 0.05
    deadline = time.monotonic() + 15  # its first try fails within ms, later on a loaded machine
    while not sender.last_error and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sender.pending == 1 and sender.last_error
    assert not sender.close(timeout=0.3)  # undeliverable: reported, not hung
