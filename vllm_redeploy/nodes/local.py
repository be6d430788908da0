"""The local transport: commands run on this machine as subprocesses."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

from vllm_redeploy.nodes.result import Stream
from vllm_redeploy.nodes.runner import OutputCapture, Runner

EXIT_NOT_FOUND = 127  # what a shell reports, so both transports agree on a missing program


class LocalRunner(Runner):
    """Runs argv here, for the node that is the controller itself."""

    def __repr__(self) -> str:
        return f"<LocalRunner {self.node}>"

    def _execute(
        self,
        argv: tuple[str, ...],
        *,
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,
        capture: OutputCapture,
    ) -> tuple[int | None, bool]:
        deadline = time.monotonic() + timeout
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **env},
                # Own process group, so a timeout kills the command and its children.
                start_new_session=True,
            )
        except FileNotFoundError:
            capture.feed("stderr", f"{argv[0]}: command not found\n".encode())
            return EXIT_NOT_FOUND, False
        if stdin is not None and proc.stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.close()
        assert proc.stdout is not None and proc.stderr is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
            selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return None, True
                for key, _ in selector.select(remaining):
                    stream: Stream = key.data
                    data = os.read(key.fd, 65536)
                    if data:
                        capture.feed(stream, data)
                    else:
                        selector.unregister(key.fileobj)
        remaining = max(deadline - time.monotonic(), 0.0)
        try:
            return proc.wait(timeout=remaining), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, True
