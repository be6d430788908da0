"""When has `ray start` in a container finished? Read from the container's own log.

`ray start` prints its success line only once the node is registered with the GCS, so seeing it
is as good as asking the cluster, and costs one Docker API call instead of a Python process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm_redeploy.nodes.docker import NodeDocker

RAY_STARTED = "Ray runtime started."
POLL_S = 0.1
TAIL_LINES = 20


@dataclass(frozen=True)
class RayStart:
    started: bool  # the success line was printed
    exit_code: int | None = None  # set when the container exited (or is gone: -1)
    tail: str = ""  # the container's last log lines, when it did not start

    @property
    def exited(self) -> bool:
        return self.exit_code is not None


def wait_ray_started(docker: NodeDocker, container: str, timeout_s: float) -> RayStart:
    """Wait up to ``timeout_s`` for ``ray start`` in ``container`` to succeed or exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = docker.get(container)
        if info is None:
            return RayStart(False, -1, "(the container is gone)")
        log = docker.logs_tail(container, lines=200)
        if RAY_STARTED in log:
            return RayStart(True)
        if not info.running:
            code = info.exit_code if info.exit_code is not None else -1
            return RayStart(False, code, _tail(log))
        if time.monotonic() >= deadline:
            return RayStart(False, None, _tail(log))
        time.sleep(POLL_S)


def _tail(log: str) -> str:
    return "\n".join(log.strip().splitlines()[-TAIL_LINES:])
