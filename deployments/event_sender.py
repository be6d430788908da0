"""A sender that posts events to Prefect without blocking its caller (the events themselves are
built in ``vllm_redeploy.events``).

A self-hosted Prefect server takes events at ``POST {api}/events``: the body is a JSON list of
events (``prefect.server.api.events.create_events(events: List[Event])``, 204 on success). The
server drops an event whose ``id`` it has already seen (the publisher deduplicates by id and the
events table inserts with ON CONFLICT DO NOTHING), so the id is derived from the cluster, the node
and its boot id: a notifier that retries the same boot produces one event.

With a spool directory, each accepted event is also a file there (written atomically) until
Prefect took it: a sender stopped before it could deliver (Prefect unreachable) leaves the files,
and the next sender on that directory sends them first.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_redeploy.events import (  # noqa: F401 - the webhook's and the tests' names for them
    EVENT_REBOOTED,
    LABEL_NODE,
    RESOURCE_LABEL_CLUSTER,
    node_resource_id,
    reboot_event,
    reboot_event_id,
)

log = logging.getLogger("vllm_redeploy.events")


@dataclass(frozen=True)
class Refusal:
    """Why an event was not queued: ``full`` (Prefect is behind), ``disk`` (the spool's disk is
    full), ``spool`` (the spool cannot take it otherwise), ``closing``."""

    kind: str
    words: str


# Prefect's answers worth retrying besides 5xx: a timeout, back-pressure, and a wrong auth string
# or URL (the operator can fix those; the events themselves are not at fault).
RETRIED = frozenset({401, 403, 404, 408, 429})


def _prefect_api() -> tuple[str | None, dict[str, str]]:
    """PREFECT_API_URL and the Authorization header Prefect's own client would send."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    headers: dict[str, str] = {}
    auth_string = PREFECT_API_AUTH_STRING.value()
    api_key = PREFECT_API_KEY.value()
    if auth_string:  # a self-hosted server with basic auth (PREFECT_SERVER_API_AUTH_STRING)
        headers["Authorization"] = "Basic " + base64.b64encode(str(auth_string).encode()).decode()
    elif api_key:  # Prefect Cloud
        headers["Authorization"] = f"Bearer {api_key}"
    return PREFECT_API_URL.value(), headers


class EventSender:
    """Posts events to Prefect from a background thread, in batches, retrying with backoff.

    ``submit`` never waits for Prefect: it queues (at most ``max_queue`` undelivered events) and
    returns False when full. Connection errors, timeouts, 5xx, 408 and 429, and 401, 403 and 404
    (a wrong auth string or URL, which the operator can fix) are retried (backoff
    ``min_backoff_s`` doubling up to ``max_backoff_s``) until delivered or until ``close`` gives
    up; other 4xx answers drop the batch with an error in the log (retrying cannot fix them).
    With ``spool_dir``, ``submit`` keeps the event on disk first (False if it cannot) and the
    file goes once Prefect answered; files an earlier sender left there are queued at start.
    """

    def __init__(
        self,
        api_url: str | None = None,
        *,
        max_queue: int = 1000,
        batch_size: int = 50,
        timeout_s: float = 10.0,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        headers: dict[str, str] | None = None,
        spool_dir: Path | str | None = None,
    ) -> None:
        default_url, auth = _prefect_api()
        url = api_url or default_url
        if not url:
            raise ValueError(
                "PREFECT_API_URL is not set: point it at your Prefect server's API "
                "(e.g. http://127.0.0.1:4200/api) so reboot events reach it"
            )
        self.api_url = url.rstrip("/")
        self._headers = {**auth, **(headers or {})}
        self._timeout_s = timeout_s
        self._batch_size = batch_size
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._max_queue = max_queue
        # Each event with its spool file (None without a spool).
        self._queue: queue.Queue[tuple[dict[str, Any], Path | None]] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self.spool = Path(spool_dir) if spool_dir is not None else None
        if self.spool is not None:
            self._queue_spooled(self.spool)
        self._closing = threading.Event()
        self._abort = threading.Event()
        self.sent = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="prefect-events", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Events accepted by ``submit`` and not yet delivered (or dropped)."""
        with self._lock:
            return self._pending

    def submit(self, event: dict[str, Any]) -> bool:
        """Queue ``event`` for delivery (in the spool first, if any); False (and nothing queued)
        when full, closed, or the spool cannot take it."""
        return self.offer(event) is None

    def offer(self, event: dict[str, Any]) -> Refusal | None:
        """As ``submit``: None when queued, else why not."""
        if self._closing.is_set():
            return Refusal("closing", "the sender is shutting down")
        with self._lock:
            if self._pending >= self._max_queue:
                log.warning("event queue full (%d): dropped %s", self._max_queue, event["id"])
                return Refusal("full", f"{self._max_queue} events are waiting for Prefect")
            path = None
            if self.spool is not None:
                try:
                    path = _write_atomically(self.spool, event)
                except (OSError, TypeError, ValueError) as exc:
                    log.error("cannot keep event %s in %s: %s", event["id"], self.spool, exc)
                    disk = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    why = exc.strerror if isinstance(exc, OSError) else str(exc)
                    return Refusal("disk" if disk else "spool", f"{self.spool}: {why}")
            self._queue.put((event, path))
            self._pending += 1
        return None

    def close(self, timeout: float = 10.0) -> bool:
        """Deliver what is queued, for up to ``timeout`` s; True when nothing is left."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(self._timeout_s + 1)
        left = self.pending
        if left and self.spool is not None:
            log.warning(
                "%d event(s) not delivered to %s yet (%s): kept in %s, sent at the next start",
                left,
                self.api_url,
                self.last_error,
                self.spool,
            )
        elif left:
            log.error("%d event(s) not delivered to %s: %s", left, self.api_url, self.last_error)
        return left == 0

    def _queue_spooled(self, spool: Path) -> None:
        """Queue the events an earlier sender left in ``spool`` (oldest first)."""
        spool.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in spool.glob(".*.tmp"):  # a write cut short: its event was never accepted
            stale.unlink(missing_ok=True)
        files = sorted(spool.glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        for path in files:
            try:
                event = json.loads(path.read_bytes())
                if not isinstance(event, dict) or not isinstance(event.get("id"), str):
                    raise ValueError("not an event")
            except (OSError, ValueError) as exc:
                log.error("%s is not a readable event (%s): set aside as .bad", path, exc)
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".bad"))
                continue
            self._queue.put((event, path))
            self._pending += 1
        if self._pending:
            log.info("%d event(s) left in %s by an earlier run: sending them", self._pending, spool)

    # --- the sending thread ---------------------------------------------------------------------

    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
            while not self._abort.is_set():
                batch = self._next_batch()
                if not batch:
                    if self._closing.is_set():
                        return
                    continue
                self._deliver(client, batch)

    def _next_batch(self) -> list[tuple[dict[str, Any], Path | None]]:
        try:
            batch = [self._queue.get(timeout=0.1)]
        except queue.Empty:
            return []
        while len(batch) < self._batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _deliver(
        self, client: httpx.Client, batch: list[tuple[dict[str, Any], Path | None]]
    ) -> None:
        delay = self._min_backoff_s
        events = [event for event, _ in batch]
        while True:
            try:
                response = client.post(f"{self.api_url}/events", json=events)
                status: int | None = response.status_code
                problem = f"HTTP {status}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                status, problem = None, f"{type(exc).__name__}: {exc}"
            if status is not None and status < 300:
                self._done(batch, delivered=True)
                return
            self.last_error = problem
            if status is not None and status < 500 and status not in RETRIED:
                if len(batch) > 1:  # one bad event refuses the batch: find it
                    log.warning("Prefect refused %d events (%s): sending them one by one",
                                len(batch), problem)  # fmt: skip
                    for one in batch:
                        self._deliver(client, [one])
                    return
                log.error("Prefect refused event %s (%s): set aside", events[0]["id"], problem)
                self._done(batch, delivered=False)
                return
            log.warning(
                "cannot post %d event(s) (%s); retrying in %.1f s", len(batch), problem, delay
            )
            if self._abort.wait(delay):
                return
            delay = min(delay * 2, self._max_backoff_s)

    def _done(self, batch: list[tuple[dict[str, Any], Path | None]], delivered: bool) -> None:
        for _, path in batch:  # Prefect has it, or refused it for good (kept to be read)
            if path is not None:
                with contextlib.suppress(OSError):
                    if delivered:
                        path.unlink(missing_ok=True)
                    else:
                        path.rename(path.with_suffix(".bad"))
        with self._lock:
            self._pending -= len(batch)
            if delivered:
                self.sent += len(batch)
            else:
                self.dropped += len(batch)
        if delivered:
            self.last_error = None


def _write_atomically(spool: Path, event: dict[str, Any]) -> Path:
    """``event`` as ``spool/ID.json``, whole or not at all, and on disk before this returns."""
    path = spool / f"{_file_name(event['id'])}.json"
    data = json.dumps(event).encode()
    fd, tmp = tempfile.mkstemp(dir=spool, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    directory = os.open(spool, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)
    return path


def _file_name(event_id: str) -> str:
    """A file name for an event id: the id when it is a UUID (all of ours), else its digest."""
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        return hashlib.sha256(event_id.encode()).hexdigest()
