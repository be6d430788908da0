"""When has `ray start` in a container finished? Read from the container's own log.

`ray start` prints its success line only once the node is registered with the GCS, so seeing it
is as good as asking the cluster, and costs no Python process. Each node's log is followed: one
streamed Docker request per node, read as its lines arrive, so the line is seen as soon as Ray
prints it and a look at 8 nodes costs what a look at 2 does (polling the logs cost two requests
per node every 0.1 s, on the controller's CPU and the nodes').
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from vllm_redeploy.nodes.docker import DockerError, NodeDocker

RAY_STARTED = "Ray runtime started."
TAIL_LINES = 20
# A follow that broke off (a read timeout on a quiet log, a dropped channel) while the container
# still runs is taken up again, from the log's start; this often at most.
FOLLOW_AGAIN_S = 0.5


@dataclass(frozen=True)
class RayStart:
    started: bool  # the success line was printed
    exit_code: int | None = None  # set when the container exited (or is gone: -1)
    tail: str = ""  # the container's last log lines, when it did not start

    @property
    def exited(self) -> bool:
        return self.exit_code is not None


def follow_ray_start(docker: NodeDocker, container: str) -> RayStart:
    """Follow ``container``'s log until ``ray start`` succeeds or the container stops."""
    while True:
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        began = time.monotonic()
        lines = docker.log_lines(container, follow=True)
        try:
            for line in lines:
                if RAY_STARTED in line:
                    return RayStart(True)
                tail.append(line)
        except DockerError:
            pass  # broke off: the container's state below says whether to follow again
        finally:
            lines.close()
        info = docker.get(container)
        if info is None:
            return RayStart(False, -1, "(the container is gone)")
        if not info.running:
            code = info.exit_code if info.exit_code is not None else -1
            return RayStart(False, code, "\n".join(tail))
        time.sleep(max(0.0, FOLLOW_AGAIN_S - (time.monotonic() - began)))


Started = tuple[str, RayStart | BaseException]  # a node's name and how its start ended


class RayStartFollowers:
    """One daemon thread per node following its Ray container's log; their results arrive in
    the order the starts end. A thread still following when nobody waits any more ends with its
    container or with the node's connection (the run closes it)."""

    def __init__(self, docker_of: Callable[[str], NodeDocker], container: str) -> None:
        self._docker_of = docker_of
        self._container = container
        self._ended: queue.Queue[Started] = queue.Queue()

    def follow(self, name: str) -> None:
        def watch() -> None:
            try:
                self._ended.put((name, follow_ray_start(self._docker_of(name), self._container)))
            except BaseException as exc:  # handed to the waiting thread, which raises it
                self._ended.put((name, exc))

        threading.Thread(target=watch, name=f"ray-start-{name}", daemon=True).start()

    def next(self, timeout_s: float) -> Started | None:
        """The next start that ended, waiting up to ``timeout_s``; None if none did."""
        try:
            return self._ended.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None
