"""The local transport: commands run on this machine as subprocesses."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import threading
import time

from vllm_redeploy.nodes.result import Stream
from vllm_redeploy.nodes.runner import OutputCapture, Process, Runner

EXIT_NOT_FOUND = 127  # what a shell reports, so both transports agree on a missing program


class LocalRunner(Runner):
    """Runs argv here, for the node that is the controller itself."""

    def __repr__(self) -> str:
        return f"<LocalRunner {self.node}>"

    def _start(self, argv: tuple[str, ...], *, env: dict[str, str], stall_s: float) -> Process:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **env},
                start_new_session=True,
            )
        except FileNotFoundError:
            proc = subprocess.Popen(  # the same "not found" a shell gives, with its exit code
                ["sh", "-c", f'echo "{argv[0]}: command not found" >&2; exit 127'],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        return _PipeProcess(proc, stall_s)

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


class _PipeProcess(Process):
    """A local subprocess with its stdin and stdout as pipes."""

    def __init__(self, proc: subprocess.Popen[bytes], stall_s: float) -> None:
        self._proc = proc
        self._stall_s = stall_s
        assert proc.stdin and proc.stdout and proc.stderr
        self._stdin, self._stdout, self._stderr = proc.stdin, proc.stdout, proc.stderr
        self._errors = bytearray()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        while data := os.read(self._stderr.fileno(), 65536):
            self._errors += data

    def read(self, size: int) -> bytes:
        ready, _, _ = select.select([self._stdout], [], [], self._stall_s)
        if not ready:
            raise TimeoutError(f"no output for {self._stall_s:g} s")
        return os.read(self._stdout.fileno(), size)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            _, ready, _ = select.select([], [self._stdin], [], self._stall_s)
            if not ready:
                raise TimeoutError(f"no input taken for {self._stall_s:g} s")
            view = view[os.write(self._stdin.fileno(), view[: 1 << 16]) :]

    def move_into(self, other: Process, size: int) -> int | None:
        """Between two local pipes, splice(2): the bytes never enter this process."""
        if not isinstance(other, _PipeProcess) or not hasattr(os, "splice"):
            return None
        source, sink = self._stdout.fileno(), other._stdin.fileno()
        while True:
            try:
                return os.splice(source, sink, size, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:  # nothing to read yet, or the sink is full: wait for both
                readable, _, _ = select.select([source], [], [], self._stall_s)
                _, writable, _ = select.select([], [sink], [], self._stall_s)
                if not (readable and writable):
                    raise TimeoutError(f"no byte moved for {self._stall_s:g} s") from None

    def close_stdin(self) -> None:
        self._stdin.close()

    def wait(self, timeout: float) -> int | None:
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=5)
        return code

    def stderr_text(self) -> str:
        return bytes(self._errors).decode("utf-8", "replace")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        for pipe in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):
                pipe.close()
