"""A Docker Engine 29 in front of a node's real Docker 20.10 engine (Debian 12 has no newer one).

Listens on its own unix socket and answers as Docker 29.0 does (read from moby's
daemon/server/middleware/version.go and daemon/config/config.go at docker-v29.0.0):
- a request to /v<N>/... with N below 1.44 gets 400 {"message": "client version N is too old.
  Minimum supported API version is 1.44, please upgrade your client to a newer version"}, one
  above 1.52 "client version N is too new. Maximum supported API version is 1.52";
- every response carries ``Api-Version: 1.52`` and ``Server: Docker/29.0.4 (linux)``; `/version`
  reports 29.0.4 with ApiVersion 1.52 and MinAPIVersion 1.44;
- the containerd image store (the default on fresh 29 installs): an image's ``Id`` in inspect and
  in the image list is its manifest's digest, not its config's (docker/cli#6670), and a
  ``Descriptor`` names that manifest (API 1.48+); a request naming an image by that digest
  reaches the image.
The rest is forwarded to the real engine, its version rewritten to 1.41 (20.10 refuses higher
ones), byte for byte otherwise: chunked and streamed bodies, and connections upgraded or hijacked
(attach, exec, logs) are piped both ways.

Run: ``python -m tests.testbed.docker29 LISTEN_SOCKET ENGINE_SOCKET``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.testbed.procs import kill_tree, spawn, wait_until

ENGINE_VERSION = "29.0.4"
MIN_API = (1, 44)
MAX_API = (1, 52)
UPSTREAM_API = "1.41"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
_VERSIONED = re.compile(r"^/v(\d+)\.(\d+)(/.*)$")
_HEX_RUN = re.compile(r"(?<![0-9a-f])[0-9a-f]{12,64}(?![0-9a-f])")
_IMAGE_INSPECT = re.compile(r"^/images/(.+)/json$")
REPO = str(Path(__file__).resolve().parents[2])
_LIMIT = 1 << 20
_COPY = 1 << 16

Headers = list[tuple[str, str]]


def _api(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


class Head:
    """An HTTP/1.1 request or response head: its first line and its headers, in order."""

    def __init__(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers: Headers = []
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                self.headers.append((name.strip(), value.strip()))

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def set(self, name: str, value: str | None) -> None:
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]
        if value is not None:
            self.headers.append((name, value))

    def encode(self) -> bytes:
        lines = [self.first, *(f"{k}: {v}" for k, v in self.headers), "", ""]
        return "\r\n".join(lines).encode("latin-1")

    @property
    def chunked(self) -> bool:
        return "chunked" in (self.get("Transfer-Encoding") or "").lower()

    def wants_close(self) -> bool:
        return "close" in (self.get("Connection") or "").lower()


async def _read_head(reader: asyncio.StreamReader) -> Head | None:
    try:
        return Head(await reader.readuntil(b"\r\n\r\n"))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def _copy_body(
    reader: asyncio.StreamReader,
    write: Callable[[bytes], None],
    head: Head,
    has_body: bool,
) -> bool:
    """Pass one message body on as it is framed; False when it runs until the connection closes
    (then nothing was read)."""
    if not has_body:
        return True
    if head.chunked:
        while True:
            line = await reader.readuntil(b"\r\n")
            write(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    write(trailer)
                write(b"\r\n")
                return True
            write(await reader.readexactly(size + 2))
    length = head.get("Content-Length")
    if length is None:
        return False
    left = int(length)
    while left:
        data = await reader.read(min(left, _COPY))
        if not data:
            raise ConnectionError("the body ended early")
        write(data)
        left -= len(data)
    return True


async def _read_body(reader: asyncio.StreamReader, head: Head) -> bytes:
    parts: list[bytes] = []
    if head.get("Content-Length") is None and not head.chunked:
        return await reader.read()
    if head.chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return b"".join(parts)
            parts.append((await reader.readexactly(size + 2))[:-2])
    return await reader.readexactly(int(head.get("Content-Length") or 0))


def _response_has_body(status: int, method: str) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


def _refusal(api: tuple[int, int], asked: str) -> str | None:
    """Docker 29's words for a version outside its range (moby's versionUnsupportedError)."""
    if api < MIN_API:
        return (
            f"client version {asked} is too old. Minimum supported API version is "
            f"{_api(MIN_API)}, please upgrade your client to a newer version"
        )
    if api > MAX_API:
        top = _api(MAX_API)
        return f"client version {asked} is too new. Maximum supported API version is {top}"
    return None


def _error(status: int, reason: str, message: str, keep: bool) -> bytes:
    body = json.dumps({"message": message}).encode() + b"\n"
    head = Head(f"HTTP/1.1 {status} {reason}\r\n".encode())
    head.headers = [
        ("Api-Version", _api(MAX_API)),
        ("Content-Type", "application/json"),
        ("Ostype", "linux"),
        ("Server", f"Docker/{ENGINE_VERSION} (linux)"),
        ("Content-Length", str(len(body))),
    ]
    if not keep:
        head.set("Connection", "close")
    return head.encode() + body


class Gate:
    def __init__(self, listen: Path, upstream: Path) -> None:
        self.listen = listen
        self.upstream = upstream
        self.manifest_of: dict[str, str] = {}  # config digest -> manifest digest
        self.config_of: dict[str, str] = {}  # manifest digest -> config digest

    # --- the containerd image store's IDs ------------------------------------------------------

    async def _upstream_json(self, path: str) -> Any:
        reader, writer = await asyncio.open_unix_connection(str(self.upstream), limit=_LIMIT)
        try:
            writer.write(
                f"GET /v{UPSTREAM_API}{path} HTTP/1.1\r\nHost: docker\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            head = await _read_head(reader)
            if head is None or " 200 " not in f"{head.first} ":
                return None
            return json.loads(await _read_body(reader, head))
        finally:
            writer.close()

    def _learn(self, inspect: dict[str, Any]) -> str:
        """The manifest an image has in the containerd store: OCI, its layers uncompressed (as
        `docker load` of a classic save stores them); its digest is what 29 shows as ``Id``."""
        config = str(inspect["Id"])
        if config not in self.manifest_of:
            manifest = {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": config, "size": 0},
                "layers": [
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                     "size": 0}
                    for d in (inspect.get("RootFS") or {}).get("Layers") or []
                ],
            }  # fmt: skip
            data = json.dumps(manifest, separators=(",", ":")).encode()
            digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
            self.manifest_of[config], self.config_of[digest] = digest, config
        return self.manifest_of[config]

    async def _learn_all(self) -> None:
        for item in await self._upstream_json("/images/json?all=1") or []:
            if item["Id"] not in self.manifest_of:
                inspect = await self._upstream_json(f"/images/{item['Id']}/json")
                if inspect:
                    self._learn(inspect)

    async def _real_ids(self, target: str) -> str:
        """``target`` with every manifest digest (or a prefix of 12+) of ours as the config's."""
        runs = set(_HEX_RUN.findall(target))
        if not runs:
            return target
        if any(not self._config_for(run) for run in runs):
            await self._learn_all()
        for run in runs:
            if config := self._config_for(run):
                found = rf"(sha256(:|%3A))?(?<![0-9a-f]){run}(?![0-9a-f])"
                target = re.sub(found, config, target, flags=re.IGNORECASE)
        return target

    def _config_for(self, run: str) -> str | None:
        found = [c for m, c in self.config_of.items() if m.removeprefix("sha256:").startswith(run)]
        return found[0] if len(found) == 1 else None

    # --- responses rewritten -------------------------------------------------------------------

    async def _rewrite(self, path: str, api: tuple[int, int], data: bytes) -> bytes:
        body = json.loads(data)
        if path == "/version":
            body.update(Version=ENGINE_VERSION, ApiVersion=_api(MAX_API))
            body["MinAPIVersion"] = _api(MIN_API)
            body["Platform"] = {"Name": "Docker Engine - Community"}
            for component in body.get("Components") or []:
                if component.get("Name") == "Engine":
                    component["Version"] = ENGINE_VERSION
                    component.setdefault("Details", {}).update(
                        ApiVersion=_api(MAX_API), MinAPIVersion=_api(MIN_API)
                    )
        elif path == "/info":
            body.update(ServerVersion=ENGINE_VERSION, Driver="overlayfs")
            body["DriverStatus"] = [["driver-type", "io.containerd.snapshotter.v1"]]
        elif path == "/images/json":
            for item in body:
                known = self.manifest_of.get(item["Id"])
                inspect = None if known else await self._upstream_json(f"/images/{item['Id']}/json")
                item["Id"] = known or (self._learn(inspect) if inspect else item["Id"])
        else:
            digest = self._learn(body)
            body["Id"] = digest
            if api >= (1, 48):
                body["Descriptor"] = {"mediaType": MANIFEST_TYPE, "digest": digest, "size": 0}
        return json.dumps(body).encode() + b"\n"

    @staticmethod
    def _rewritten(method: str, path: str) -> bool:
        return method == "GET" and (
            path in ("/version", "/info", "/images/json") or bool(_IMAGE_INSPECT.match(path))
        )

    # --- connections ---------------------------------------------------------------------------

    async def serve(self) -> None:
        self.listen.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self._client, str(self.listen), limit=_LIMIT)
        os.chmod(self.listen, 0o660)
        upstream = os.stat(self.upstream)  # the engine's own socket: its group (docker) reaches it
        os.chown(self.listen, upstream.st_uid, upstream.st_gid)
        async with server:
            await server.serve_forever()

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while (request := await _read_head(creader)) is not None:
                method, target = [*request.first.split(" "), "", ""][:2]
                api, path = MAX_API, target
                if m := _VERSIONED.match(target):
                    api, path = (int(m[1]), int(m[2])), m[3]
                    if refused := _refusal(api, f"{m[1]}.{m[2]}"):
                        await _copy_body(creader, lambda _: None, request, True)
                        cwriter.write(_error(400, "Bad Request", refused, True))
                        await cwriter.drain()
                        continue
                    target = f"/v{UPSTREAM_API}{path}"
                bare = path.split("?", 1)[0]
                if bare.startswith("/images"):
                    target = await self._real_ids(target)
                if upstream is None:
                    upstream = await asyncio.open_unix_connection(str(self.upstream), limit=_LIMIT)
                ureader, uwriter = upstream
                request.first = f"{method} {target} HTTP/1.1"
                uwriter.write(request.encode())
                sending = asyncio.ensure_future(_copy_body(creader, uwriter.write, request, True))
                while (response := await _read_head(ureader)) is not None:
                    status = int(response.first.split(" ")[1])
                    if not 100 <= status < 200 or status == 101:
                        break
                    cwriter.write(response.encode())  # 100 Continue
                if response is None:
                    sending.cancel()
                    return
                if response.get("Api-Version"):
                    response.set("Api-Version", _api(MAX_API))
                if response.get("Server"):
                    response.set("Server", f"Docker/{ENGINE_VERSION} (linux)")
                if status == 200 and self._rewritten(method, bare):
                    body = await self._rewrite(bare, api, await _read_body(ureader, response))
                    response.set("Transfer-Encoding", None)
                    response.set("Content-Length", str(len(body)))
                    cwriter.write(response.encode() + body)
                    delimited = True
                else:
                    cwriter.write(response.encode())
                    delimited = status != 101 and await _copy_body(
                        ureader, cwriter.write, response, _response_has_body(status, method)
                    )
                await cwriter.drain()
                if not delimited:  # upgraded or hijacked: raw bytes both ways until it closes
                    await sending
                    await _pipe_both(creader, cwriter, ureader, uwriter)
                    return
                await sending
                if request.wants_close() or response.wants_close():
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if upstream is not None:
                upstream[1].close()
            cwriter.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(_COPY):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _pipe_both(
    creader: asyncio.StreamReader,
    cwriter: asyncio.StreamWriter,
    ureader: asyncio.StreamReader,
    uwriter: asyncio.StreamWriter,
) -> None:
    """The client's bytes to the engine (stdin, half-closed when it is done) while the engine's
    come back; over when the engine closes."""
    to_engine = asyncio.ensure_future(_pump(creader, uwriter))
    await _pump(ureader, cwriter)
    to_engine.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await to_engine


@dataclass
class DockerGate:
    """The gate as the bed runs it: one process per gated node, in the node's namespace."""

    socket: Path
    upstream: Path
    log: Path
    pid: int = 0
    enter: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        argv = [*self.enter, sys.executable, "-m", "tests.testbed.docker29"]
        proc = spawn([*argv, str(self.socket), str(self.upstream)], self.log, {"PYTHONPATH": REPO})
        self.pid = proc.pid
        wait_until(self._answers, 30, f"the Docker 29 gate at {self.socket}", self.log)

    def _answers(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")

    def stop(self) -> None:
        if self.pid:
            kill_tree(self.pid, grace=2)
            self.pid = 0
        self.socket.unlink(missing_ok=True)


def main() -> None:
    listen, upstream = Path(sys.argv[1]), Path(sys.argv[2])
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, os._exit, 0)  # nothing to flush: the engine holds all
    loop.run_until_complete(Gate(listen, upstream).serve())


if __name__ == "__main__":
    main()
