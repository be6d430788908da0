"""The registry of backends and the one rule that picks one.

``[vllm] backend`` names one, or ``auto``: the first backend, in the registry's order, that
runs on the image (each asks the image its own question, a one-shot container on the head: mp's,
whether the image's `vllm serve` has --nnodes; Ray's, whether `ray` runs there), so vLLM's own
launcher wherever the image's vLLM has it (no Ray to start: up seconds sooner, less memory), and
Ray only for a vLLM without it.
A new backend is a subclass of launch/backend.py's Backend, given to :func:`register`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch import mp, ray
from vllm_redeploy.launch.backend import Backend
from vllm_redeploy.launch.entrypoint import ImageEntrypoint
from vllm_redeploy.launch.fingerprint import plan_fingerprint
from vllm_redeploy.launch.group import NodeFabric
from vllm_redeploy.launch.loader import Loader, choose_loader, with_loader
from vllm_redeploy.launch.plan import LaunchPlan

AUTO = "auto"
# In auto's order: the first that runs on the image is taken. One that asks nothing runs on
# any image, so it comes last.
BACKENDS: dict[str, Backend] = {b.name: b for b in (mp.MP, ray.RAY)}
Answers = Mapping[str, str | None]  # each backend's answer, by name, as the image gave it


def register(backend: Backend) -> Backend:
    """Add a backend. One that asks the image is tried by ``auto`` before those that ask
    nothing; one that asks nothing comes after them (auto never reaches it: a configuration
    names it)."""
    if not backend.condition:
        BACKENDS[backend.name] = backend
        return backend
    asking = {n: b for n, b in BACKENDS.items() if b.condition}
    rest = {n: b for n, b in BACKENDS.items() if not b.condition}
    BACKENDS.clear()
    BACKENDS.update({**asking, backend.name: backend, **rest})
    return backend


def backend_problem(config: ClusterConfig) -> str | None:
    """Why ``[vllm] backend`` names no registered backend, in the configuration's words; None
    when it names one (or auto)."""
    name = config.vllm.backend
    if name == AUTO or name in BACKENDS:
        return None
    known = [repr(n) for n in (AUTO, *BACKENDS)]
    listed = f"{', '.join(known[:-1])} or {known[-1]}"
    return f"vllm.backend: Input should be {listed} (got {name!r})"


def reason(backend: str, why: str) -> str:
    """``mp (configured; vLLM's own multi-node launcher)``"""
    return f"{backend} ({'; '.join(filter(None, (why, BACKENDS[backend].words)))})"


def _named(config: ClusterConfig) -> list[Backend]:
    """The backends the choice may take: the configured one, or auto's up to the first that
    runs on any image."""
    if problem := backend_problem(config):
        raise ValueError(problem)
    if config.vllm.backend != AUTO:
        return [BACKENDS[config.vllm.backend]]
    taken = []
    for backend in BACKENDS.values():
        if not backend.condition and taken:  # auto never reaches one that asks nothing
            break
        taken.append(backend)
        if not backend.condition:
            break
    return taken


def asks_the_image(config: ClusterConfig) -> bool:
    """Does the choice need the image's answers (preflight's one-shot containers on the
    head)?"""
    return any(b.question(config) is not None for b in _named(config))


def choose(config: ClusterConfig, answers: Answers) -> tuple[str, str]:
    """(backend, why in words), given each backend's answer from the image (none: it was not
    asked, or the backend asks nothing)."""
    named = _named(config)
    backend = config.vllm.backend
    if backend != AUTO:
        return backend, reason(backend, "configured")
    passed_over = []
    for candidate in named:
        found = candidate.found(answers.get(candidate.name))
        if found is not None:
            return candidate.name, reason(candidate.name, found or "; ".join(passed_over))
        passed_over.append(candidate.absent)
    raise ValueError(f"no backend runs on image {config.vllm.image}: {'; '.join(passed_over)}")


def refusal(config: ClusterConfig, answers: Answers) -> str | None:
    """Why the configured backend cannot run on this image (None: it can)."""
    backend = config.vllm.backend
    if backend == AUTO:
        return None
    return _named(config)[0].refusal(config, answers.get(backend))


def candidates(config: ClusterConfig) -> list[tuple[str, str]]:
    """What a run may launch before the image is asked (the dry run shows each)."""
    named = _named(config)
    if config.vllm.backend != AUTO:
        return [(config.vllm.backend, reason(config.vllm.backend, "configured"))]
    found = []
    passed_over: list[str] = []
    for backend in named:
        when = backend.condition or " and ".join(passed_over)
        found.append((backend.name, reason(backend.name, f"if {when}")))
        passed_over.append(backend.absent)
    return found


AUTO_NOTE = (
    "backend auto: a one-shot container of the image decides when the run starts "
    "(mp if its vLLM has --nnodes, else ray if Ray runs in it); both launches follow"
)


def assumed(config: ClusterConfig) -> str:
    """The backend when nothing runs to say which: the configured one (auto counts as the
    first in its order, mp, the backend every vLLM since --nnodes takes)."""
    return _named(config)[0].name


def launch_fingerprint(config: ClusterConfig, backend: str | None = None) -> str:
    """The fingerprint a group of ``backend`` (default: :func:`assumed`) launched with these
    settings carries: its own members' specs, from the settings alone."""
    backend = backend or assumed(config)
    return plan_fingerprint(config, BACKENDS[backend].plan(config, None, ""))


def plan_for(
    backend: str,
    config: ClusterConfig,
    fabric: Mapping[str, NodeFabric] | None = None,
    why: str = "",
    entrypoint: ImageEntrypoint | None = None,
    loader: Loader | None = None,
) -> LaunchPlan:
    """The backend's plan for ``config``, the image's ENTRYPOINT (kept when it runs its
    arguments) and the loader chosen from its vLLM (auto's choice passed as --load-format),
    stamped with the launch fingerprint (which depends on the settings alone: auto's choice is
    not in it, so a group keeps its fingerprint when an image gains or loses a loader)."""
    loader = loader or choose_loader(config, None)
    built = BACKENDS[backend].plan(with_loader(config, loader), fabric, why).for_image(entrypoint)
    named = replace(built, loader=loader.words, load_format=loader.name or "default")
    return named.stamped(launch_fingerprint(config, backend))
