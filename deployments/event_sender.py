"""A sender that posts events to Prefect without blocking its caller (the events themselves are
built in ``vllm_redeploy.events``).

A self-hosted Prefect server takes events at ``POST {api}/events``: the body is a JSON list of
events (``prefect.server.api.events.create_events(events: List[Event])``, 204 on success). The
server drops an event whose ``id`` it has already seen (the publisher deduplicates by id and the
events table inserts with ON CONFLICT DO NOTHING), so the id is derived from the cluster, the node
and its boot id: a notifier that retries the same boot produces one event.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
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

    ``submit`` never blocks: it queues (bounded) and returns False when the queue is full.
    Connection errors, timeouts, 408, 429 and 5xx are retried (backoff ``min_backoff_s`` doubling
    up to ``max_backoff_s``) until delivered or until ``close`` gives up; other 4xx answers drop
    the batch with an error in the log (retrying cannot fix them).
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
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max_queue)
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
        """Queue ``event`` for delivery; False (and nothing queued) when full or closed."""
        if self._closing.is_set():
            return False
        with self._lock:
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                log.warning("event queue full (%d): dropped %s", self._queue.maxsize, event["id"])
                return False
            self._pending += 1
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Deliver what is queued, for up to ``timeout`` s; True when nothing is left."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(self._timeout_s + 1)
        left = self.pending
        if left:
            log.error("%d event(s) not delivered to %s: %s", left, self.api_url, self.last_error)
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

    def _next_batch(self) -> list[dict[str, Any]]:
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

    def _deliver(self, client: httpx.Client, batch: list[dict[str, Any]]) -> None:
        delay = self._min_backoff_s
        while True:
            try:
                response = client.post(f"{self.api_url}/events", json=batch)
                status: int | None = response.status_code
                problem = f"HTTP {status}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                status, problem = None, f"{type(exc).__name__}: {exc}"
            if status is not None and status < 300:
                self._done(batch, delivered=True)
                return
            self.last_error = problem
            if status is not None and status < 500 and status not in (408, 429):
                log.error("Prefect refused %d event(s): %s", len(batch), problem)
                self._done(batch, delivered=False)
                return
            log.warning(
                "cannot post %d event(s) (%s); retrying in %.1f s", len(batch), problem, delay
            )
            if self._abort.wait(delay):
                return
            delay = min(delay * 2, self._max_backoff_s)

    def _done(self, batch: list[dict[str, Any]], delivered: bool) -> None:
        with self._lock:
            self._pending -= len(batch)
            if delivered:
                self.sent += len(batch)
            else:
                self.dropped += len(batch)
        if delivered:
            self.last_error = None
