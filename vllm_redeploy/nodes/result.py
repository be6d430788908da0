"""The one result type every transport returns."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from vllm_redeploy.masking import masked

Stream = Literal["stdout", "stderr"]


def render_command(argv: Sequence[str], secrets: Sequence[str] = ()) -> str:
    """The shell rendering of argv with every secret value masked, for logs and errors."""
    return masked(shlex.join(argv), secrets)


@dataclass(frozen=True)
class CommandResult:
    """What a command did on a node.

    ``exit_code`` is None when the command never finished (timed out or the connection was
    lost); ``stdout``/``stderr`` then hold what arrived before that.
    """

    node: str
    argv: tuple[str, ...]
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def tail(self, stream: Stream = "stderr", lines: int = 15) -> str:
        text = self.stdout if stream == "stdout" else self.stderr
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])
