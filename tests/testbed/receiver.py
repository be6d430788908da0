"""A notification endpoint on loopback for the alert tests: what Prefect's Custom Webhook block
posts, kept."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.testbed.procs import free_port


class Receiver(ThreadingHTTPServer):
    """A notification endpoint on loopback: keeps every JSON body posted to it."""

    def __init__(self, host: str) -> None:
        self.bodies: list[dict[str, Any]] = []
        super().__init__((host, free_port(host)), _Handler)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.server.bodies.append(json.loads(self.rfile.read(length)))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def receiving(host: str) -> Iterator[Receiver]:
    """A receiver serving on ``host`` (a free port) for the block's posts."""
    server = Receiver(host)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def webhook_block(receiver: Receiver) -> str:
    """A Prefect Custom Webhook notification block posting to ``receiver``; its TYPE/NAME."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    host, port = str(receiver.server_address[0]), int(receiver.server_address[1])
    name = f"alerts-{uuid.uuid4().hex[:8]}"
    CustomWebhookNotificationBlock(
        name="operator",
        url=f"http://{host}:{port}/notify",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save(name)
    return f"custom-webhook/{name}"


def post_event(prefect_api: str, event: dict[str, Any]) -> None:
    event = {"id": str(uuid.uuid4()), "occurred": datetime.now(UTC).isoformat(), **event}
    httpx.post(f"{prefect_api}/events", json=[event], timeout=10).raise_for_status()


def arm(prefect_api: str, receiver: Receiver, cluster: str) -> None:
    """Post a `vllm.cluster.failed` of step "arming" for ``cluster`` until its alert comes back,
    then forget it: Prefect's triggers load a new automation on their next pass, and an event
    that comes before is never matched."""
    resource = {"prefect.resource.id": f"vllm-redeploy.cluster.{cluster}"}
    deadline = time.monotonic() + 120
    while not any("arming" in b["subject"] for b in receiver.bodies):
        assert time.monotonic() < deadline, receiver.bodies
        payload = {"step": "arming", "reason": "loaded yet?"}
        post_event(
            prefect_api, {"event": "vllm.cluster.failed", "resource": resource, "payload": payload}
        )
        time.sleep(2)
    time.sleep(2)  # a second arming alert may be on its way
    receiver.bodies.clear()


def ghost_cluster(path: Path, cluster: str, address: str, extra: str = "") -> Path:
    """A cluster file at ``path`` whose only node never answers (nothing listens on its SSH
    port): a run of it fails at preflight within seconds. ``extra``: more TOML at its end."""
    known_hosts = path.parent / "known_hosts"
    known_hosts.write_text("")
    path.write_text(
        f'name = "{cluster}"\n'
        "[[nodes]]\n"
        'name = "ghost"\n'
        f'address = "{address}"\n'
        f"ssh_port = {free_port(address)}\n"
        "[ssh]\n"
        f'known_hosts = "{known_hosts}"\n'
        "connect_timeout_s = 1\n"
        "[vllm]\n"
        'image = "vllm/vllm-openai:v0.19.0"\n'
        'model = "/models/Qwen3.5-122B-A10B-FP8"\n'
        "tensor_parallel_size = 1\n"
        "[deadlines]\n"
        "nodes_reachable_s = 1\n" + extra
    )
    return path
