"""The libraries that reach nodes for us log through our logger, at debug level.

paramiko logs from its own transport thread: a port that answers but does not speak SSH makes it
log ``Exception (client): Error reading SSH protocol banner`` and two stack traces at ERROR, which
Python prints to stderr when nothing else handles them, above our own one-line problem (the
``NodeUnreachable`` that says the same thing, in words). urllib3 (under the docker SDK) warns about
its connection pools the same way. Their records go to ``vllm_redeploy.nodes`` at DEBUG: there for
whoever turns debug logging on, never in front of the person reading our message.
"""

from __future__ import annotations

import logging

from vllm_redeploy.safe_text import one_line

LIBRARIES = ("paramiko", "urllib3", "docker")
TARGET = "vllm_redeploy.nodes"


class _AtDebug(logging.Handler):
    """Re-emits a library's records through our logger, at DEBUG, each on one line."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__(logging.DEBUG)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a library's own bad format string must not become a traceback
            message = repr(record.msg)
        self.target.debug("%s: %s", record.name, one_line(message))


def route_library_logs() -> None:
    """Send the node libraries' logging to ours at debug level (once; safe to call again)."""
    target = logging.getLogger(TARGET)
    for name in LIBRARIES:
        library = logging.getLogger(name)
        if not any(isinstance(h, _AtDebug) for h in library.handlers):
            library.addHandler(_AtDebug(target))
        library.propagate = False
