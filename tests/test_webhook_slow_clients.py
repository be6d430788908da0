"""The reboot webhook against clients without the secret that connect and then send slowly, or
nothing: a real uvicorn (in this process, or `serve_webhook` in its own under a low open-file
limit), raw sockets for the slow clients, httpx for the nodes' signed notices, the session's
Prefect server for the events."""

from __future__ import annotations

import secrets
import selectors
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from deployments.event_sender import EventSender
from deployments.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, running_webhook
from tests.conftest import keep_for_notes
from tests.test_webhook import make_config, notice, signed, wait_for_event
from tests.test_webhook_spool import forwarding, spool_base, webhook_process

pytestmark = pytest.mark.integration

NODES = ("node-1", "node-2", "node-3")  # node-3 never reports: no cluster event
SLOW = 200
NOTICES = 20
DEADLINE_S = 5.0  # [webhook] header_timeout_s and body_timeout_s, the defaults
SLACK_S = 2.5  # timers on two busy shared cores fire late, never early


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _head(url: str) -> bytes:
    return f"POST /reboot HTTP/1.1\r\nHost: {_address(url)[0]}\r\n".encode()


def half_headers(url: str) -> socket.socket:
    sock = socket.create_connection(_address(url), timeout=10)
    sock.sendall(_head(url) + TIMESTAMP_HEADER.encode() + b": ")
    return sock


def half_body(url: str) -> socket.socket:
    """Headers that pass every check made before the body (fresh time, a signature of the right
    shape), then 20 of the 200 bytes promised: the app waits for the rest."""
    sock = socket.create_connection(_address(url), timeout=10)
    headers = (
        f"{TIMESTAMP_HEADER}: {int(time.time())}\r\n{SIGNATURE_HEADER}: sha256={'0' * 64}\r\n"
        "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    )
    sock.sendall(_head(url) + headers.encode() + b'{"node": "node-1", ')
    return sock


def half_next_request(url: str) -> socket.socket:
    """One complete request answered, then the first line of the next (keep-alive)."""
    sock = socket.create_connection(_address(url), timeout=10)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        chunk = sock.recv(4096)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    return sock


class Trickle(threading.Thread):
    """Sends one more header byte to each of its sockets every half second (each byte used to
    restart uvicorn's keep-alive timer), until they are closed or it is stopped."""

    def __init__(self, socks: list[socket.socket]) -> None:
        super().__init__(daemon=True)
        self.socks = list(socks)
        self.stop = threading.Event()

    def run(self) -> None:
        while self.socks and not self.stop.wait(0.5):
            for sock in list(self.socks):
                try:
                    sock.send(b"a")
                except OSError:
                    self.socks.remove(sock)


def wait_closed(opened: dict[socket.socket, float], within_s: float) -> dict[socket.socket, float]:
    """Seconds from opening until the server closed each socket, for those it closed in time."""
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as selector:
        for sock in opened:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + within_s
        while len(closed) < len(opened) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(65536):
                        continue  # an answer (a refusal); the close comes next
                except BlockingIOError:
                    continue
                except OSError:  # reset
                    pass
                closed[sock] = time.monotonic() - opened[sock]
                selector.unregister(sock)
    return closed


@pytest.fixture
def in_process(prefect_api: str) -> Iterator[tuple[str, str, str, EventSender]]:
    secret = secrets.token_hex(32)
    config = make_config(f"whslow{uuid.uuid4().hex[:8]}", secret, NODES, reboot_delay_s=3600)
    sender = EventSender(prefect_api)
    try:
        with running_webhook(config, sender) as url:
            yield url, config.name, secret, sender
    finally:
        assert sender.close(timeout=10)


def signed_notices(url: str, secret: str, count: int) -> tuple[list[float], list[str]]:
    """Latencies (s) of ``count`` signed notices, each on a new connection as a notifier's curl
    sends it, and their event ids; every one must be accepted."""
    latencies, ids = [], []
    for i in range(count):
        body, headers = signed(secret, notice(NODES[i % 2]))
        started = time.monotonic()
        response = httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)
        latencies.append(time.monotonic() - started)
        assert response.status_code == 202, response.text
        ids.append(response.json()["event_id"])
    return latencies, ids


def figures(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    return f"p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms over {len(ms)}"


@pytest.mark.timeout(120)
def test_200_slow_clients_neither_delay_a_signed_notice_nor_stay_open(
    in_process: tuple[str, str, str, EventSender], prefect_api: str
) -> None:
    url, cluster, secret, _ = in_process
    kinds: list[Callable[[str], socket.socket]] = [half_headers, half_body, half_next_request]
    opened: dict[socket.socket, float] = {}
    trickled: list[socket.socket] = []
    for i in range(SLOW):
        if i % 4 == 3:
            trickled.append(half_headers(url))
            opened[trickled[-1]] = time.monotonic()
        else:
            opened[kinds[i % 4](url)] = time.monotonic()
    trickle = Trickle(trickled)
    trickle.start()
    try:
        time.sleep(0.5)  # every slow client is in, and sending (or not)
        latencies, ids = signed_notices(url, secret, NOTICES)
        closed = wait_closed(opened, DEADLINE_S + SLACK_S)
    finally:
        trickle.stop.set()
        for sock in opened:
            sock.close()
    summary = (
        f"signed notices with {SLOW} slow clients connected: {figures(latencies)}; "
        f"{len(closed)} of {SLOW} slow clients closed by the server, after "
        f"{min(closed.values(), default=0):.1f} to {max(closed.values(), default=0):.1f} s"
    )
    print(summary)
    keep_for_notes("webhook_slow_clients", summary + "\n")
    assert max(latencies) < 1.0, summary
    # Each slow client is cut off at its deadline (not before: none was evicted, the cap is
    # higher), the ones that kept sending a byte every half second too.
    assert len(closed) == SLOW, summary
    assert min(closed.values()) > DEADLINE_S - 0.5, summary
    for event_id in ids:  # and every notice reached Prefect
        wait_for_event(prefect_api, cluster, event_id)


@pytest.mark.timeout(180)
def test_150_idle_connections_under_128_open_files_block_no_notice_and_flood_no_log(
    prefect_api: str, tmp_path: Path
) -> None:
    """Under a 128-file limit (soft and hard), 150 connections that send nothing: the cap keeps
    accept() from running out of files, each newcomer closes the oldest idle one, and the
    warnings about it are counted, not repeated."""
    secret, cluster = secrets.token_hex(32), f"whfd{uuid.uuid4().hex[:8]}"
    log = tmp_path / "webhook.log"
    config = make_config(cluster, secret, NODES)
    with (
        webhook_process(cluster, secret, log, tmp_path, open_files=128) as url,
        forwarding(config, spool_base(tmp_path), prefect_api),
    ):
        idle = [socket.create_connection(_address(url), timeout=10) for _ in range(150)]
        try:
            time.sleep(0.5)
            latencies, ids = signed_notices(url, secret, 5)
            time.sleep(DEADLINE_S + 1)  # the survivors' header deadlines pass too
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        finally:
            for sock in idle:
                sock.close()
        for event_id in ids:  # the spool still had a file for each, the watcher posted it
            wait_for_event(prefect_api, cluster, event_id)
    text = log.read_text(errors="replace")
    summary = (
        f"150 idle connections under 128 open files: signed notices {figures(latencies)}; "
        f"service log {log.stat().st_size} bytes"
    )
    print(summary)
    keep_for_notes("webhook_open_files", summary + "\n\n" + text)
    assert max(latencies) < 1.0, summary
    assert "Too many open files" not in text and "Traceback" not in text, text[-3000:]
    assert log.stat().st_size < 20_000, summary
