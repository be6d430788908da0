"""Whether the group's containers keep the image's ENTRYPOINT.

Docker appends a container's command to the image's ENTRYPOINT. A program there
(`vllm/vllm-openai`: ``["vllm", "serve"]``) would run ours as its arguments, so we replace it.
A script that ends by running its arguments (NGC's /opt/nvidia/nvidia_entrypoint.sh: ``exec
"$@"``) also prepares the environment (on NGC, the CUDA forward-compatibility libraries; a GB10
without them fails FlashInfer's JIT with cudaErrorUnsupportedPtxVersion), so we keep it and pass
our program as its command, as NVIDIA's playbook does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_redeploy.nodes.result import render_command

# `exec "$@"`, `exec "${@}"`, optionally after other words of the same line (`set -e; exec "$@"`).
RUNS_ITS_ARGUMENTS = re.compile(r'(^|[;&|]\s*)exec\s+"\$(@|\{@\})"\s*$')


@dataclass(frozen=True)
class ImageEntrypoint:
    argv: tuple[str, ...] | None  # the image's ENTRYPOINT; None: it declares none
    runs_its_arguments: bool = False  # a script whose last command is exec "$@"

    @classmethod
    def of(cls, argv: Sequence[str] | None, script: str | None) -> ImageEntrypoint:
        return cls(tuple(argv) if argv else None, script is not None and runs_arguments(script))

    @property
    def kept(self) -> bool:
        return self.runs_its_arguments

    def why(self) -> str:
        """In words, for the dry run and the summary."""
        if self.argv is None:
            return "the image declares no ENTRYPOINT: the program is set explicitly"
        named = render_command(list(self.argv))
        if self.kept:
            return f'the image\'s ENTRYPOINT {named} is kept: it ends in exec "$@"'
        return f"the image's ENTRYPOINT {named} is replaced: it does not run its arguments"


def runs_arguments(script: str) -> bool:
    """Is the script's last command ``exec "$@"`` (comments and blank lines aside)?"""
    lines = [line.strip() for line in script.splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    return bool(commands) and RUNS_ITS_ARGUMENTS.search(commands[-1]) is not None
