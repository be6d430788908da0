"""A sender that posts events to Prefect without blocking its caller (the events themselves are
built in ``vllm_redeploy.events``).

A self-hosted Prefect server takes events at ``POST {api}/events``: the body is a JSON list of
events (``prefect.server.api.events.create_events(events: List[Event])``, 204 on success). The
server drops an event whose ``id`` it has already seen (the publisher deduplicates by id and the
events table inserts with ON CONFLICT DO NOTHING), so the id is derived from the cluster, the node
and its boot id: a notifier that retries the same boot produces one event.

The reboot webhook's events reach it from the spool (``deployments.spool``), handed over by the
watcher's forwarder with ``adopt``: each file is removed once Prefect took its event.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import queue
import threading
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
    up; another 4xx sets aside the one event Prefect refuses, with an error in the log (retrying
    cannot fix it). An adopted event's file goes once Prefect took it (``.bad`` if refused).
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
        # Each event with its spool file (None for one submitted).
        self._queue: queue.Queue[tuple[dict[str, Any], Path | None]] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
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
        """Queue ``event`` for delivery; False (and nothing queued) when full or closing."""
        return self.offer(event) is None

    def offer(self, event: dict[str, Any]) -> Refusal | None:
        """As ``submit``: None when queued, else why not."""
        refused = self._put(event, None)
        if refused is not None and refused.kind == "full":
            log.warning("event queue full (%d): dropped %s", self._max_queue, event["id"])
        return refused

    def adopt(self, event: dict[str, Any], path: Path) -> bool:
        """Queue ``event``, kept on disk as ``path`` by another process (the webhook's spool):
        removed once Prefect took it, set aside as ``.bad`` if Prefect refuses it. False (nothing
        queued) when full or closing: the file stays for a later try."""
        return self._put(event, path) is None

    def _put(self, event: dict[str, Any], path: Path | None) -> Refusal | None:
        if self._closing.is_set():
            return Refusal("closing", "the sender is shutting down")
        with self._lock:
            if self._pending >= self._max_queue:
                return Refusal("full", f"{self._max_queue} events are waiting for Prefect")
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
        if left:
            log.warning("%d event(s) not delivered to %s yet: %s", left, self.api_url,
                        self.last_error)  # fmt: skip
        return left == 0

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
