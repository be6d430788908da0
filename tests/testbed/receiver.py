"""A notification endpoint on loopback for the alert tests: what Prefect's Custom Webhook block
posts, kept."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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
