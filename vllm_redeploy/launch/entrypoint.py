"""Whether the group's containers keep the image's ENTRYPOINT.

Docker appends a container's command to the image's ENTRYPOINT. A program there
(`vllm/vllm-openai`: ``["vllm", "serve"]``) would run ours as its arguments, so we replace it.
A script that ends by running its arguments also prepares the environment: NGC's
/opt/nvidia/nvidia_entrypoint.sh sources /opt/nvidia/entrypoint.d/*.sh (the banner, the CUDA
forward-compatibility libraries; a GB10 without them fails FlashInfer's JIT with
cudaErrorUnsupportedPtxVersion) and ends with ``if [[ $# -eq 0 ]]; then exec "/bin/bash"; else
exec "$@"; fi``. So we keep such a script and pass our program as its command, as NVIDIA's
playbook does. Two endings count: a last ``exec "$@"``, and an if/else whose branch taken when
there are arguments is ``exec "$@"`` (on one line or several).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_redeploy.nodes.result import render_command

# `exec "$@"` or `exec "${@}"`: one command (the script is split into commands first).
RUNS_ITS_ARGUMENTS = re.compile(r'exec\s+"\$(@|\{@\})"')
# The test of an if whose one branch runs the arguments: how many there are, against 0 or 1.
_OPERATOR = r"(?P<op>-eq|-ne|-gt|-lt|-ge|-le|==|!=|=|>=|<=|>|<)"
_COUNT = rf'(\[\[?|\(\()\s*"?\$\{{?#\}}?"?\s*{_OPERATOR}\s*"?(?P<n>[01])"?\s*(\]\]?|\)\))'
ARGUMENT_COUNT = re.compile(rf"if\s+{_COUNT}")
# (operator, number) -> whether the test is true when there are arguments ("then" runs them).
_WITH_ARGUMENTS = {
    ("-gt", "0"): True, (">", "0"): True, ("-ne", "0"): True, ("!=", "0"): True,
    ("-ge", "1"): True, (">=", "1"): True,
    ("-eq", "0"): False, ("==", "0"): False, ("=", "0"): False, ("-lt", "1"): False,
    ("<", "1"): False, ("-le", "0"): False, ("<=", "0"): False,
}  # fmt: skip
# Words that begin a command of their own after them (`then exec "$@"`).
_KEYWORDS = ("then", "else", "do")


@dataclass(frozen=True)
class ImageEntrypoint:
    argv: tuple[str, ...] | None  # the image's ENTRYPOINT; None: it declares none
    runs_its_arguments: bool = False  # a script that ends by running exec "$@" (see above)

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
            return (
                f"the image's ENTRYPOINT {named} is kept: it prepares the environment, then "
                'runs its arguments (exec "$@")'
            )
        return f"the image's ENTRYPOINT {named} is replaced: it does not run its arguments"


def runs_arguments(script: str) -> bool:
    """Does the script end by running its arguments: a last command ``exec "$@"``, or a last
    if/else on the number of arguments whose branch for some runs ``exec "$@"``?"""
    commands = shell_commands(script)
    if commands and _is_exec_arguments(commands[-1]):
        return True
    if len(commands) < 6 or commands[-1] != "fi":
        return False
    test, then, when_true, else_, when_false = commands[-6:-1]
    count = ARGUMENT_COUNT.fullmatch(test)
    if count is None or (then, else_) != ("then", "else"):
        return False
    with_arguments = _WITH_ARGUMENTS.get((count["op"], count["n"]))
    if with_arguments is None:
        return False
    return _is_exec_arguments(when_true if with_arguments else when_false)


def shell_commands(script: str) -> list[str]:
    """The script's commands in order: comments and blank lines left out, lines split at ``;``
    and a leading ``then``/``else``/``do`` made a command of its own. Enough to read how a
    script ends; not a shell parser."""
    commands: list[str] = []
    for line in script.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split(";"):
            part = part.strip()
            while part:
                word, _, rest = part.partition(" ")
                if word in _KEYWORDS and rest.strip():
                    commands.append(word)
                    part = rest.strip()
                    continue
                commands.append(part)
                break
    return commands


def _is_exec_arguments(command: str) -> bool:
    return RUNS_ITS_ARGUMENTS.fullmatch(command.strip()) is not None
