"""Typed, picklable errors of node access.

Prefect persists task failures, so every error defines ``__reduce__``: an exception whose
``__init__`` takes more than the message cannot be unpickled otherwise.
"""

from __future__ import annotations

from vllm_redeploy.masking import hide
from vllm_redeploy.nodes.result import CommandResult, render_command
from vllm_redeploy.safe_text import block, one_line

TAIL_LINES = 15


class RemoteError(Exception):
    """Base of everything that can go wrong while reaching or using a node."""

    def __init__(self, node: str, message: str) -> None:
        message = hide(message)  # a log tail in it may hold a secret of the run
        super().__init__(message)
        self.node = node
        self.message = message

    def __reduce__(self):  # type: ignore[override]
        return (RemoteError, (self.node, self.message))

    def __str__(self) -> str:
        return self.message


class NodeUnreachable(RemoteError):
    """The node could not be reached: DNS, TCP, SSH handshake, authentication or host key."""

    def __init__(self, node: str, reason: str, hint: str = "") -> None:
        message = f"cannot reach node {node}: {one_line(reason)}"
        if hint:
            message += f". {one_line(hint)}"
        super().__init__(node, message)
        self.reason = reason
        self.hint = hint

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.node, self.reason, self.hint))


class HostKeyRejected(NodeUnreachable):
    """The node's SSH host key is unknown or differs from known_hosts."""


class AuthenticationFailed(NodeUnreachable):
    """The node refused every key we offered."""


class ConnectionLost(NodeUnreachable):
    """The connection dropped while a command ran; whether it finished is unknown."""


class CommandError(RemoteError):
    """A command ran but did not succeed; carries its result (with partial output)."""

    def __init__(self, result: CommandResult, secrets: tuple[str, ...] = ()) -> None:
        self.result = result
        self.secrets = secrets
        super().__init__(result.node, self._describe())

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.result, self.secrets))

    def _headline(self) -> str:
        raise NotImplementedError

    def _describe(self) -> str:
        command = render_command(self.result.argv, self.secrets)
        lines = [one_line(f"{self._headline()} on {self.result.node}: {command}")]
        for stream in ("stderr", "stdout"):
            tail = self.result.tail(stream, TAIL_LINES)  # type: ignore[arg-type]
            if tail:
                lines.append(f"last {stream} lines:\n{block(tail)}")
                break
        text = "\n".join(lines)
        for secret in self.secrets:
            if secret:
                text = text.replace(secret, "*****")
        return text


class CommandFailed(CommandError):
    """The command exited non-zero."""

    def _headline(self) -> str:
        return f"command failed with exit code {self.result.exit_code}"


class CommandTimedOut(CommandError):
    """The command did not finish within its wall-clock timeout."""

    def _headline(self) -> str:
        return f"command timed out after {self.result.duration_s:.1f} s"
