"""Which weight loader the engine reads the model with: ``[vllm] load_format``.

``auto`` (the default) asks the image (launch/image_vllm.py) and passes ``--load-format
instanttensor`` when its vLLM accepts it and its Python imports it, else ``fastsafetensors`` on
the same terms, else nothing (vLLM's own default: memory-mapped safetensors, through the page
cache). ``default`` passes nothing; any other name is passed as it is. A ``--load-format`` in
``[vllm] extra_args`` always wins: nothing is added then.

The choice is made per run, from the image; the launch fingerprint takes the setting, not the
choice (launch/choose.py), so a group started before an image gained a loader is not replaced
for that alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_redeploy.config import ClusterConfig

if TYPE_CHECKING:  # launch/image_vllm.py builds its question with launch/group.py, which reads
    # the configured loader here
    from vllm_redeploy.launch.image_vllm import ImageVllm

# The loaders auto takes, best first: InstantTensor reads with direct I/O (no page cache, which
# on unified memory is the GPU's own pool) and splits the reading between the ranks;
# fastsafetensors splits the shard files between the ranks (vLLM's DGX Spark post, eugr's
# recipes).
FAST_LOADERS = ("instanttensor", "fastsafetensors")
AUTO = "auto"
DEFAULT = "default"  # vLLM's own choice: no --load-format
_FLAG = "--load-format"
_DEFAULT_WORDS = "vLLM's default loader"


@dataclass(frozen=True)
class Loader:
    """The loader the engine uses (None: vLLM's default) and why; ``added``: whether the run
    adds ``--load-format name`` (not when extra_args gives it)."""

    name: str | None
    why: str
    added: bool = True

    @property
    def argument(self) -> str | None:
        """What the run passes as --load-format (None: nothing of its own)."""
        return self.name if self.added else None

    @property
    def words(self) -> str:
        """``instanttensor (auto: the image has it)``"""
        return f"{self.name or _DEFAULT_WORDS} ({self.why})"


def extra_args_loader(config: ClusterConfig) -> str | None:
    """The ``--load-format`` that ``[vllm] extra_args`` gives (``--load-format X``,
    ``--load-format=X`` or vLLM's underscore spelling), or None."""
    args = config.vllm.extra_args
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag.replace("_", "-") != _FLAG:
            continue
        if equals:
            return value
        return args[index + 1] if index + 1 < len(args) else ""
    return None


def configured(config: ClusterConfig) -> str | None:
    """The --load-format the settings alone pass (None for auto and default, and when
    extra_args gives one): what the launch fingerprint sees."""
    name = config.vllm.load_format
    if name in (AUTO, DEFAULT) or extra_args_loader(config) is not None:
        return None
    return name


def choose_loader(config: ClusterConfig, image: ImageVllm | None) -> Loader:
    """The loader for this run, given what the image's vLLM said (None: not asked)."""
    if (given := extra_args_loader(config)) is not None:
        return Loader(given or None, "from [vllm] extra_args, which wins", added=False)
    name = config.vllm.load_format
    if name == DEFAULT:
        return Loader(None, "configured")
    if name != AUTO:
        return Loader(name, "configured")
    if image is None:
        return Loader(None, "auto: the image was not asked")
    if not image.answered:
        said = f": {image.said}" if image.said else ""
        return Loader(None, f"auto: the image's `vllm serve --help` failed{said}")
    for fast in FAST_LOADERS:
        if image.has_loader(fast):
            return Loader(fast, "auto: the image has it")
    return Loader(None, f"auto: {'; '.join(_lacks(image, fast) for fast in FAST_LOADERS)}")


def with_loader(config: ClusterConfig, loader: Loader) -> ClusterConfig:
    """``config`` as the launch reads it: auto's choice in place of "auto" (the fingerprint
    keeps reading the configuration itself)."""
    if config.vllm.load_format != AUTO or loader.argument is None:
        return config
    vllm = config.vllm.model_copy(update={"load_format": loader.argument})
    return config.model_copy(update={"vllm": vllm})


def loader_refusal(config: ClusterConfig, image: ImageVllm | None) -> str | None:
    """Why the configured fast loader cannot load on this image, with the fix; None: it can
    (or nothing can be told: the image did not answer, or the name is a plugin's)."""
    name = configured(config)
    if name not in FAST_LOADERS or image is None or not image.answered:
        return None
    if image.has_loader(name):
        return None
    return (
        f"[vllm] load_format = {name!r}, but {_lacks(image, name)} ({config.vllm.image}): "
        'the engine would fail at its load. Set load_format = "auto" '
        f"(the fastest loader the image has), or use an image with {name} installed "
        f"(`pip install {name}` in one built FROM it)"
    )


def planned_words(config: ClusterConfig) -> str:
    """The loader before the image is asked (check-config, the dry run)."""
    if config.vllm.load_format == AUTO and extra_args_loader(config) is None:
        first, second = FAST_LOADERS
        return (
            f"auto: {first} if the image has it, else {second}, else {_DEFAULT_WORDS} "
            "(asked of the image when the run starts)"
        )
    return choose_loader(config, None).words


def _lacks(image: ImageVllm, name: str) -> str:
    if not image.accepts(name):
        return f"the image's vLLM does not accept {name}"
    return f"the image's Python does not import {name}"
