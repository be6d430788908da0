"""Every answer we read over HTTP from a node is read whole within a deadline and up to a size.

httpx's timeouts bound each read, not the request: anything on the head's API port that sends a
byte a second (a process that bound the port after the engine died, with host networking) would
hold a look, ``status`` or a run for good, and a body of any size would be read whole. Here the
body is streamed and counted, and a timer shuts the connection's socket at the deadline, which
ends a read blocked in the headers as well as in the body.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

CAP_BYTES = 1024 * 1024  # an API answer of ours: /v1/models, /version, a probe's reply
METRICS_CAP_BYTES = 8 * 1024 * 1024  # the engine's /metrics: histograms per model and LoRA


class AnswerTooLarge(httpx.HTTPError):
    """The answer went past its byte cap; what came is dropped."""


@dataclass(frozen=True)
class Answer:
    status_code: int
    content: bytes
    elapsed_s: float
    headers: httpx.Headers = field(default_factory=httpx.Headers)

    @property
    def text(self) -> str:
        charset = httpx.Response(200, headers=self.headers).charset_encoding or "utf-8"
        return self.content.decode(charset, "replace")

    def json(self) -> Any:
        return json.loads(self.content)


def fetch(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    deadline_s: float | None = None,
    cap_bytes: int = CAP_BYTES,
    **kwargs: Any,
) -> Answer:
    """``client.request(method, url, **kwargs)``, read whole within ``deadline_s`` (default:
    the client's read timeout, as a total) and ``cap_bytes``. Past the deadline it raises
    ``httpx.ReadTimeout``; past the cap, ``AnswerTooLarge``: both are ``httpx.HTTPError``."""
    deadline = client.timeout.read if deadline_s is None else deadline_s
    if deadline is None:
        raise ValueError("an answer needs a deadline: give deadline_s or a client read timeout")
    sockets: list[socket.socket] = []
    expired = threading.Event()

    def trace(event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete" and info.get("return_value") is not None:
            sockets.append(info["return_value"].get_extra_info("socket"))

    def expire() -> None:
        expired.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read; close() would not

    timer = threading.Timer(deadline, expire)
    timer.daemon = True
    started = time.monotonic()
    timer.start()
    try:
        with client.stream(method, url, extensions={"trace": trace}, **kwargs) as response:
            stream = response.extensions.get("network_stream")
            if stream is not None:  # a pooled connection: no connect to trace
                sockets.append(stream.get_extra_info("socket"))
            if expired.is_set():
                raise httpx.ReadTimeout("expired", request=response.request)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > cap_bytes:
                    raise AnswerTooLarge(
                        f"the answer from {url} is larger than {cap_bytes // 1024} KiB"
                    )
                if expired.is_set():
                    raise httpx.ReadTimeout("expired", request=response.request)
        return Answer(
            response.status_code, bytes(body), time.monotonic() - started, response.headers
        )
    except httpx.HTTPError as exc:
        if expired.is_set() and not isinstance(exc, AnswerTooLarge):
            raise httpx.ReadTimeout(f"no whole answer from {url} within {deadline:g} s") from None
        raise
    finally:
        timer.cancel()
