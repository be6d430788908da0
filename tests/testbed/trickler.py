"""A server on a real socket that answers slowly or too much: for the deadline and the cap on
every answer we read over HTTP (vllm_redeploy/answers.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

Serve = Callable[[socket.socket], None]


@contextlib.contextmanager
def server(serve: Serve, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """A server on ``host``:``port`` that answers every connection with ``serve``."""
    listener = socket.create_server((host, port))
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    def handle(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.recv(65536)
            serve(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def trickle(data: bytes, every_s: float = 0.2) -> Serve:
    def serve(conn: socket.socket) -> None:
        for i in range(len(data)):
            conn.sendall(data[i : i + 1])
            time.sleep(every_s)

    return serve


def answer(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


def trickle_after_headers(data: bytes) -> Serve:
    head, body = data.split(b"\r\n\r\n", 1)

    def serve(conn: socket.socket) -> None:
        conn.sendall(head + b"\r\n\r\n")
        trickle(body)(conn)

    return serve
