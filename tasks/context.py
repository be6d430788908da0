"""What every task of one flow run shares: the configuration and one connection per node.

Tasks receive the ``Run`` but never return connections: results stay plain data (picklable,
cacheable), and connections are opened inside tasks and reused through the run's pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger

from tasks.records import Recorder
from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.masking import hide
from vllm_redeploy.nodes import (
    AuthenticationFailed,
    ConnectionLost,
    DockerError,
    HostKeyRejected,
    NodeAccess,
    NodeUnreachable,
)


class Connections:
    """One ``NodeAccess`` per node, opened on first use and shared by the run's tasks.

    A plain class, not a dataclass or a mapping, on purpose: Prefect walks every task's inputs
    (dataclass fields, dicts) as it creates the task run, and a table that another task's thread
    is filling would break that walk ("dictionary changed size during iteration").
    """

    def __init__(self) -> None:
        self._open: dict[str, NodeAccess] = {}
        self._lock = threading.Lock()

    def get(self, name: str, open_: Callable[[], NodeAccess]) -> NodeAccess:
        with self._lock:
            if name not in self._open:
                self._open[name] = open_()
            return self._open[name]

    def close(self) -> None:
        with self._lock:
            for access in self._open.values():
                access.close()
            self._open.clear()


@dataclass
class Run:
    config: ClusterConfig
    records: Recorder = field(default_factory=Recorder)  # what it tells the Prefect server
    connections: Connections = field(default_factory=Connections)
    # While the run holds the cluster: raises StepFailed once another run has taken it.
    hold_check: Callable[[], None] | None = None

    def before_change(self) -> None:
        """Right before a call that changes a node (a unit stopped, a container removed or
        started): a run that lost the cluster (paused past its lease, and another took it) must
        not touch what the new holder started, nor retry into it."""
        if self.hold_check is not None:
            self.hold_check()

    def node(self, name: str) -> NodeAccess:
        return self.connections.get(name, lambda: NodeAccess(self.node_config(name), self.config))

    def node_config(self, name: str) -> NodeConfig:
        return next(n for n in self.config.nodes if n.name == name)

    @property
    def head(self) -> NodeAccess:
        return self.node(self.config.head.name)

    def close(self) -> None:
        self.connections.close()

    def __reduce__(self) -> Any:
        # Task inputs may be serialized (cache keys, result records); connections must not be.
        return (Run, (self.config,))


class StepFailed(Exception):
    """A step failed for a reason that retrying will not fix; the message says what to do."""

    def __init__(self, step: str, reason: str) -> None:
        reason = hide(reason)  # Prefect makes the step's state message of it
        super().__init__(f"{step}: {reason}")
        self.step = step
        self.reason = reason

    def __reduce__(self) -> Any:
        return (StepFailed, (self.step, self.reason))


def transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: only dropped connections and Docker API hiccups are worth a retry."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, HostKeyRejected | AuthenticationFailed):
        return False
    if isinstance(exc, DockerError):
        return exc.transient
    return isinstance(exc, ConnectionLost | NodeUnreachable)


# Retry policies, only ever for transient faults (see ``transient``), with backoff.
# Read-only or idempotent steps: two retries.
RETRY_TRANSIENT: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": [2, 5],
    "retry_condition_fn": transient,
}
# Steps that start containers: one retry (each attempt first removes what the last one made).
RETRY_START: dict[str, Any] = {
    "retries": 1,
    "retry_delay_seconds": [3],
    "retry_condition_fn": transient,
}


def log() -> Any:
    return get_run_logger()
