"""What a run records on the Prefect server while it works (progress, artifacts, events) is
best-effort, and never holds a step up: the server away for a minute or four (a restart, an
upgrade, a stalled controller) must not cost a load, and a report that cannot be written must
never tear down what it reports on.

Records are written in order on one thread of the run's, each in the context of the task or
flow that asked (so an artifact still belongs to its flow run). One that fails waits, by its
key, for the API to answer again: only the latest value of a key is kept (a progress bar needs
its last value, not every one it missed). The run logs once that the API is away and once that
it is back, and ``flush`` at the end waits for what is still pending (the summary among it), for
a while.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext
from prefect.logging.loggers import flow_run_logger
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from vllm_redeploy.safe_text import one_line

RETRY_S = 3.0  # while the API is away, a pending record is tried this often
FLUSH_S = 300.0  # at the end, how long a run waits for the API to take what it could not
# Calls that fail fast and are asked again on our own schedule (RETRY_S here, the lock's POLL_S):
# with the client's own backoff (2, 4 ... s between tries, 256 s under `serve`, which raises the
# retries for its runner) the first call after an outage could come minutes after the server.
CLIENT_RETRIES = 2
P = ParamSpec("P")
T = TypeVar("T")


def on_own_schedule(fn: Callable[P, T]) -> Callable[P, T]:
    """Run ``fn`` with the Prefect client's retries cut to ``CLIENT_RETRIES``."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: CLIENT_RETRIES}):
            return fn(*args, **kwargs)

    return wrapper


class Recorder:
    """One run's records, written in order on one thread; failed ones kept by key."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[contextvars.Context, Callable[[], Any]]] = {}
        self._changed = threading.Condition()
        self._busy = False
        self._away_since: float | None = None
        self._thread: threading.Thread | None = None
        self._log: Any = None

    def record(self, key: str, write: Callable[[], Any]) -> None:
        """Write ``write()`` soon, replacing what is still pending under ``key``."""
        context = contextvars.copy_context()
        with self._changed:
            if self._log is None:
                self._log = _flow_run_logger()  # also for the writer thread
            self._pending.pop(key, None)  # the newest goes last: written in the order asked
            self._pending[key] = (context, write)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="records", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def flush(self, wait_s: float = FLUSH_S) -> list[str]:
        """Wait up to ``wait_s`` until every record is written; the keys still pending."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._changed.notify_all()
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._changed.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))
            return list(self._pending)

    @property
    def away(self) -> bool:
        return self._away_since is not None

    def _write(self) -> None:
        while True:
            with self._changed:
                while not self._pending:
                    self._changed.wait()
                key = next(iter(self._pending))
                context, write = self._pending.pop(key)
                self._busy = True
            try:
                context.run(on_own_schedule(write))
            except Exception as exc:
                with self._changed:
                    self._pending.setdefault(key, (context, write))  # unless a newer came
                    self._busy = False
                    self._went_away(exc)
                    self._changed.wait(RETRY_S)
                continue
            with self._changed:
                self._busy = False
                self._came_back()
                self._changed.notify_all()

    def _went_away(self, exc: Exception) -> None:
        if self._away_since is None:
            self._away_since = time.monotonic()
            self._log.warning(
                "the Prefect API did not take this run's records (%s): the run goes on, and "
                "what it could not record is written when the API answers again",
                one_line(exc),
            )

    def _came_back(self) -> None:
        if self._away_since is not None:
            self._log.info(
                "the Prefect API answers again, %.0f s after a record first failed: writing "
                "what it missed",
                time.monotonic() - self._away_since,
            )
            self._away_since = None


def _flow_run_logger() -> Any:
    """The flow run's logger, also when a task asks first: what the records say is the run's."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        return flow_run_logger(context.flow_run, context.flow)
    return get_run_logger()


class Progress:
    """A progress artifact written through a ``Recorder``: created when the API first takes it,
    then moved; while the API is away only its latest value waits."""

    def __init__(self, recorder: Recorder, key: str, description: str) -> None:
        self.recorder, self.key, self.description = recorder, key, description
        self._id: Any = None

    def set(self, percent: float, description: str | None = None) -> None:
        self.recorder.record(f"progress:{self.key}", lambda: self._write(percent, description))

    def _write(self, percent: float, description: str | None) -> None:
        if self._id is None:
            self._id = create_progress_artifact(
                percent, key=self.key, description=description or self.description
            )
        else:
            update_progress_artifact(self._id, percent, description=description)
