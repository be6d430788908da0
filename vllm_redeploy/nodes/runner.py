"""The one interface for running a command on a node; transports supply the primitives.

``Runner.run`` owns the lifecycle (validation, timing, streaming, check); a transport only
implements ``_execute``. Nothing here knows about Prefect: the task layer passes ``on_line``
to route output to its logger.
"""

from __future__ import annotations

import codecs
import re
import secrets
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Self

from vllm_redeploy.nodes.errors import CommandFailed, CommandTimedOut
from vllm_redeploy.nodes.result import CommandResult, Stream

LineCallback = Callable[[str, Stream], None]
DEFAULT_TIMEOUT_S = 60.0
CHECK_TIMEOUT_S = 5.0


class OutputCapture:
    """Collects a command's output and hands each complete line to ``on_line`` as it arrives."""

    def __init__(self, on_line: LineCallback | None) -> None:
        self._on_line = on_line
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in _STREAMS}
        self._text: dict[Stream, list[str]] = {s: [] for s in _STREAMS}
        self._partial: dict[Stream, str] = {s: "" for s in _STREAMS}

    def feed(self, stream: Stream, data: bytes, final: bool = False) -> None:
        text = self._decoders[stream].decode(data, final=final)
        if not text:
            return
        self._text[stream].append(text)
        if self._on_line is None:
            return
        *lines, self._partial[stream] = (self._partial[stream] + text).split("\n")
        for line in lines:
            self._on_line(line.rstrip("\r"), stream)

    def finish(self) -> None:
        for stream in _STREAMS:
            self.feed(stream, b"", final=True)
            if self._on_line is not None and self._partial[stream]:
                self._on_line(self._partial[stream], stream)
                self._partial[stream] = ""

    def text(self, stream: Stream) -> str:
        return "".join(self._text[stream])


_STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")


class Process(ABC):
    """A command started on a node whose stdin and stdout are byte streams, for data too big to
    hold in memory (an image, a model). Reads and writes raise ``TimeoutError`` when nothing
    moves for the ``stall_s`` the process was started with."""

    @abstractmethod
    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes of stdout; b"" once the command closed it."""

    @abstractmethod
    def write(self, data: bytes) -> None:
        """All of ``data`` to the command's stdin."""

    @abstractmethod
    def close_stdin(self) -> None:
        """Tell the command its input has ended."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when the command still runs after ``timeout`` seconds."""

    @abstractmethod
    def stderr_text(self) -> str:
        """What the command wrote to stderr (call after it exited)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the command (and drop its streams); safe to call twice."""

    def move_into(self, other: Process, size: int) -> int | None:
        """Up to ``size`` bytes of stdout straight into ``other``'s stdin, inside the kernel;
        0 at the end of stdout; None when these two cannot (then ``read`` and ``write``)."""
        return None


class Runner(ABC):
    """Runs argv on one node. Use as a context manager, or call ``close()``."""

    def __init__(
        self, node: str, secrets: Sequence[str] = (), default_timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.node = node
        self.default_timeout = default_timeout
        # Values masked in every message that renders a command (defence in depth: secrets
        # travel by stdin or files, never by argv).
        self.secrets = tuple(s for s in secrets if s)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        on_line: LineCallback | None = None,
    ) -> CommandResult:
        """Run argv and return its result.

        ``timeout`` is wall-clock seconds (default: the runner's ``default_timeout``).
        ``check=False`` only silences a non-zero exit:
        a timeout (``CommandTimedOut``) or an unreachable node (``NodeUnreachable``) always raise.
        """
        argv = tuple(argv)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError(f"argv must be a non-empty sequence of str, got {argv!r}")
        capture = OutputCapture(on_line)
        started = time.monotonic()
        exit_code, timed_out = self._execute(
            argv,
            env=dict(env or {}),
            stdin=stdin,
            timeout=self.default_timeout if timeout is None else timeout,
            capture=capture,
        )
        capture.finish()
        result = CommandResult(
            node=self.node,
            argv=argv,
            exit_code=exit_code,
            stdout=capture.text("stdout"),
            stderr=capture.text("stderr"),
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
        )
        if timed_out:
            raise CommandTimedOut(result, self.secrets)
        if check and not result.ok:
            raise CommandFailed(result, self.secrets)
        return result

    def run_all(
        self, commands: Sequence[Sequence[str]], *, timeout: float | None = None
    ) -> list[CommandResult]:
        """Run several short commands in one round trip (one `sh -c` on the node), each as if
        by ``run(check=False)``; a round trip costs 0.1-0.4 s, and a step that asks a node five
        questions paid for five. Each command's stdout and exit code come back; its stderr is
        dropped on the way (no temporary file on the node to keep it apart): for a failure's
        words, ``run`` that one again (``checked``)."""
        argvs = [tuple(argv) for argv in commands]
        if not argvs or not all(argvs):
            raise TypeError("run_all needs one or more non-empty commands")
        mark = f"@@vrd-{secrets.token_hex(6)}"  # no command's output can forge it
        lines = [
            f"printf '%s\\n' {shlex.quote(f'{mark} {i}')}; {shlex.join(argv)} 2>/dev/null; "
            f"printf '\\n%s %s\\n' {shlex.quote(f'{mark} rc {i}')} \"$?\""
            for i, argv in enumerate(argvs)
        ]
        batch = self.run(["sh", "-c", "\n".join(lines)], timeout=timeout, check=False)
        found = {
            int(i): (text.removesuffix("\n"), int(code))
            for i, text, code in re.findall(
                rf"^{re.escape(mark)} (\d+)\n(.*?)^{re.escape(mark)} rc \1 (\d+)$",
                batch.stdout,
                re.M | re.S,
            )
        }
        if len(found) != len(argvs):  # the script itself broke off: no answer is "failed"
            raise CommandFailed(batch, self.secrets)
        return [
            CommandResult(self.node, argv, found[i][1], found[i][0], "", batch.duration_s)
            for i, argv in enumerate(argvs)
        ]

    def checked(self, result: CommandResult, timeout: float | None = None) -> CommandResult:
        """``result`` when it succeeded; else its command run again alone, so that the failure
        raised (``CommandFailed``) carries its own words (stderr)."""
        if result.ok:
            return result
        return self.run(result.argv, timeout=timeout)

    def start(
        self, argv: Sequence[str], *, stall_s: float, env: Mapping[str, str] | None = None
    ) -> Process:
        """Start argv with streamed stdin and stdout (see ``Process``); the caller waits for it
        and kills it on failure."""
        argv = tuple(argv)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError(f"argv must be a non-empty sequence of str, got {argv!r}")
        return self._start(argv, env=dict(env or {}), stall_s=stall_s)

    def check_connection(self, timeout: float = CHECK_TIMEOUT_S) -> float:
        """Run ``true`` on the node; return the round-trip time in seconds."""
        return self.run(["true"], timeout=timeout).duration_s

    def round_trip_s(self, timeout: float = CHECK_TIMEOUT_S) -> float:
        """Seconds for one `true` on an open connection (the first call may connect)."""
        self.check_connection(timeout)
        return self.check_connection(timeout)

    @abstractmethod
    def _execute(
        self,
        argv: tuple[str, ...],
        *,
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,
        capture: OutputCapture,
    ) -> tuple[int | None, bool]:
        """Run argv, feeding output to ``capture``; return (exit code, timed out)."""

    def _start(self, argv: tuple[str, ...], *, env: dict[str, str], stall_s: float) -> Process:
        """Start argv with its stdin and stdout as streams."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream a command's data")

    def close(self) -> None:  # noqa: B027 - transports without a connection have nothing to do
        """Release the connection, if the transport holds one."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
