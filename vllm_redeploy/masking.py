"""The configuration's secrets masked wherever a run writes text: its log (every handler, so
Prefect's API log and the console alike), its artifacts, its events and its state message.

Secrets travel by stdin, files and the environment, never argv; but a failure's reason may
embed a log tail, and a log may hold what a process printed of its environment.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

MASK = "*****"
SHORTEST = 4  # a shorter value would mask ordinary words; secrets are longer than this


def masked(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret's value replaced by the mask."""
    for secret in secrets:
        if len(secret) >= SHORTEST:
            text = text.replace(secret, MASK)
    return text


_hidden: dict[int, tuple[str, ...]] = {}  # the secrets of every run under way in this process
_lock = threading.Lock()


def hide(text: str) -> str:
    """``text`` with the secrets of every run under way here masked: what a failure's reason
    (StepFailed, a node's error) goes through when it is made, so the state message that
    Prefect makes of it holds none of them."""
    for secrets in list(_hidden.values()):
        text = masked(text, secrets)
    return text


class MaskSecrets(logging.Filter):
    """Masks a record's message and its traceback before any handler writes them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _hidden:
            return True
        message = record.getMessage()
        if (hidden := hide(message)) != message:
            record.msg, record.args = hidden, None
        if record.exc_info and not record.exc_text:
            trace = logging.Formatter().formatException(record.exc_info)
            record.exc_text = hide(trace)  # formatters use it as it is
        return True


_filter = MaskSecrets()


def mask_logs(secrets: Iterable[str]) -> Callable[[], None]:
    """Mask ``secrets`` in what every logging handler of this process writes and in every
    failure made here (:func:`hide`), from now until the returned function is called."""
    kept = tuple(s for s in secrets if len(s) >= SHORTEST)
    if not kept:
        return lambda: None
    token = object()
    with _lock:
        _hidden[id(token)] = kept
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for lg in loggers:
            for handler in getattr(lg, "handlers", []):
                if _filter not in handler.filters:
                    handler.addFilter(_filter)

    def stop() -> None:
        with _lock:
            _hidden.pop(id(token), None)

    return stop
