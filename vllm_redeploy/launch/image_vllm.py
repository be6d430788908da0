"""What the image's vLLM says of itself: the weight loaders its ``--load-format`` accepts, the
fast ones its Python imports, and whether its `vllm serve` has its own multi-node launcher
(``--nnodes``).

Asked by one one-shot container of the image on the head, cached with the image's other facts
(tasks/image_facts.py): its `vllm serve --help=all` (plain ``--help`` where vLLM predates the
keyword, as 0.8 does), cut to the two arguments read here, then an import of each fast loader.
vLLM imports itself to print its help, so this costs what a vLLM start costs before the model:
seconds, once per image ID.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch.group import ENGINE_ROLE, group_spec, node_env
from vllm_redeploy.launch.loader import FAST_LOADERS
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec

# A fixed program, no configuration in it: the help's lines for --load-format (its first line
# up to the next argument's) and --nnodes, the help's exit code, and each loader that imports.
_SCRIPT = """
import importlib, subprocess
def helped(flag):
    try:
        done = subprocess.run(["vllm", "serve", flag], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as error:
        return 127, str(error)
    return done.returncode, done.stdout + done.stderr
code, text = helped("--help=all")
if code != 0:
    code, text = helped("--help")
inside = False
for line in text.splitlines():
    word = line.strip()
    if word.startswith("--"):
        inside = word.startswith("--load-format")
        if word.startswith("--nnodes"):
            print("help:", line)
    if inside:
        print("help:", line)
if code != 0:
    print("said:", (text.strip().splitlines() or ["nothing"])[-1])
print("help-exit:", code)
for name in %s:
    try:
        importlib.import_module(name)
        print("imports:", name)
    except Exception as error:
        print("no-import:", name, type(error).__name__)
""" % (FAST_LOADERS,)  # noqa: UP031 - the script's own braces would need doubling otherwise
QUESTION_ARGV = ("python3", "-c", _SCRIPT)
QUESTION_TIMEOUT_S = 300.0  # vLLM's import on a node whose page cache is cold
# Loaders in vLLM's --load-format choices before it took any name (0.8.4's list has
# fastsafetensors): every later vLLM accepts them, whether its help lists them or not (0.32's
# description leaves fastsafetensors out).
ACCEPTED_SINCE_CHOICES = frozenset({"fastsafetensors"})
_NAMES_QUOTED = re.compile(r'^\s*- "([\w.-]+)"')
_CHOICES = re.compile(r"--load-format \{([^}]*)\}")
_NNODES = re.compile(r"^\s*--nnodes\b", re.MULTILINE)


@dataclass(frozen=True)
class ImageVllm:
    """The image's vLLM as it answered; ``answered`` False when its help failed (no vLLM
    there, or one that cannot start), and nothing else is known then."""

    answered: bool
    load_formats: tuple[str, ...] = ()  # what --load-format accepts, as its help lists them
    choices: bool = False  # the help lists --load-format's choices: nothing else parses
    nnodes: bool = False  # `vllm serve --nnodes`: vLLM's own multi-node launcher
    imports: tuple[str, ...] = ()  # the fast loaders its Python imports
    said: str = ""  # the help's last line when it failed

    def accepts(self, name: str) -> bool:
        if name in self.load_formats:
            return True
        return self.answered and not self.choices and name in ACCEPTED_SINCE_CHOICES

    def has_loader(self, name: str) -> bool:
        return self.accepts(name) and name in self.imports


def question_spec(config: ClusterConfig) -> ContainerSpec:
    """The one-shot container on the head: the image, its environment as the engine gets it
    (the stand-in's, or a vLLM plugin's, variables), no GPUs."""
    spec = group_spec(
        config,
        name=container_name(config.name, f"{ENGINE_ROLE}-check"),
        role=ENGINE_ROLE,
        backend="",
        argv=QUESTION_ARGV,
        env=node_env(config.head, config, None),
        fabric=None,
        volumes=list(config.vllm.volumes),
    )
    return replace(spec, gpus=None)


def parse_answer(exit_code: int, output: str) -> ImageVllm:
    """The container's lines, as :data:`QUESTION_ARGV` prints them."""
    said = [line.partition(": ") for line in output.splitlines()]
    help_lines = [value for key, _, value in said if key == "help"]
    values = {key: value.strip() for key, _, value in said if key in ("help-exit", "said")}
    imports = tuple(value.strip() for key, _, value in said if key == "imports")
    if exit_code != 0 or values.get("help-exit") != "0":
        return ImageVllm(False, imports=imports, said=values.get("said", ""))
    text = "\n".join(help_lines)
    formats = load_formats(text)
    strict = bool(_CHOICES.search(text))
    return ImageVllm(True, formats, strict, bool(_NNODES.search(text)), imports)


def load_formats(help_text: str) -> tuple[str, ...]:
    """The names ``--load-format`` accepts: its choices (``{auto,pt,...}``, vLLM up to 0.9) or
    the ``- "name" will ...`` lines of its description (later, where any plugin's name
    parses)."""
    if choices := _CHOICES.search(help_text):
        return tuple(c.strip() for c in choices.group(1).split(",") if c.strip())
    return tuple(m.group(1) for line in help_text.splitlines() if (m := _NAMES_QUOTED.match(line)))
