"""A Prefect API that fails or lags on cue: a reverse proxy in front of a real Prefect server
that answers 500 to the requests a test names, holds back those it says for as long as it says,
and passes everything else through (HTTP, and the events websocket both ways), so a run talks to
the real server otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.testbed.procs import drain_prefect_workers, free_port, wait_until

# Which requests fail: (method, path under /api, JSON body) -> True to answer 500.
Cue = Callable[[str, str, object], bool]
# How long a request is held back before it goes on: (method, path under /api) -> seconds.
Delay = Callable[[str, str], float]


def never(method: str, path: str, body: object) -> bool:
    return False


class FlakyApi:
    def __init__(self, upstream: str, cue: Cue, delay: Delay | None = None) -> None:
        self.upstream, self.cue, self.delay = upstream.rstrip("/"), cue, delay
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.failed: list[str] = []  # "METHOD /path" of each request answered 500
        self._lock = threading.Lock()

    async def _http(self, request: Request) -> Response:
        path = request.url.path.removeprefix("/api")
        body = await request.body()
        try:
            parsed: object = json.loads(body) if body else None
        except ValueError:
            parsed = None
        with self._lock:
            fail = self.cue(request.method, path, parsed)
            if fail:
                self.failed.append(f"{request.method} {path}")
        if fail:
            return Response('{"detail": "the test answers 500"}', status_code=500)
        if self.delay is not None:
            await asyncio.sleep(self.delay(request.method, path))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.request(
                request.method,
                f"{self.upstream}{path}",
                params=request.query_params,
                content=body,
                headers=headers,
            )
        drop = ("content-encoding", "content-length", "transfer-encoding", "connection")
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in drop}
        return Response(answer.content, status_code=answer.status_code, headers=kept)

    async def _socket(self, socket: WebSocket) -> None:
        asked = list(socket.scope.get("subprotocols", []))  # Prefect's clients ask "prefect"
        await socket.accept(subprotocol=asked[0] if asked else None)
        target = self.upstream.replace("http://", "ws://", 1) + socket.url.path.removeprefix("/api")
        async with websockets.connect(target, subprotocols=asked or None) as upstream:

            async def down() -> None:
                async for message in upstream:
                    text = message if isinstance(message, str) else message.decode()
                    await socket.send_text(text)

            task = asyncio.create_task(down())
            try:
                while True:
                    await upstream.send(await socket.receive_text())
            except (WebSocketDisconnect, websockets.ConnectionClosed):
                pass
            finally:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def app(self) -> Starlette:
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
        return Starlette(
            routes=[
                WebSocketRoute("/api/{path:path}", self._socket),
                Route("/api/{path:path}", self._http, methods=methods),
            ]
        )


@contextmanager
def flaky_api(upstream: str, cue: Cue = never, delay: Delay | None = None) -> Iterator[FlakyApi]:
    """The proxy, serving on a thread of the test's process for the block."""
    proxy = FlakyApi(upstream, cue, delay)
    config = uvicorn.Config(proxy.app(), host="127.0.0.1", port=proxy.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="flaky-api", daemon=True)
    thread.start()

    def answers() -> bool:
        try:
            return httpx.get(f"{proxy.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, 30, "the flaky API")
    try:
        yield proxy
    finally:
        # Prefect's events and logs workers are one per process, bound to the API URL they
        # started with: a flow run in this process through the proxy leaves them sending to it.
        # Flushed and stopped while it still answers, the next ones start at the current URL
        # (else a later test's events go to a closed port).
        drain_prefect_workers()
        server.should_exit = True
        thread.join(10)
