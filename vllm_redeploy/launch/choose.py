"""The one rule for which backend launches the group, and the registry of backends.

``[vllm] backend`` names one, or ``auto``: Ray when Ray runs in the image (a one-shot
container on the head tells preflight), else vLLM's own launcher. A new backend is a module
with a ``plan(config, fabric, reason)`` function and one line in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch import mp, ray
from vllm_redeploy.launch.entrypoint import ImageEntrypoint
from vllm_redeploy.launch.fingerprint import plan_fingerprint
from vllm_redeploy.launch.group import NodeFabric
from vllm_redeploy.launch.plan import LaunchPlan

PlanBuilder = Callable[[ClusterConfig, Mapping[str, NodeFabric] | None, str], LaunchPlan]
BACKENDS: dict[str, PlanBuilder] = {
    ray.BACKEND: ray.plan,
    mp.BACKEND: mp.plan,
}
# What each backend is, for people, after its name.
WHAT = {mp.BACKEND: "vLLM's own multi-node launcher"}
AUTO = "auto"


def reason(backend: str, why: str) -> str:
    """``mp (configured; vLLM's own multi-node launcher)``"""
    return f"{backend} ({'; '.join(filter(None, (why, WHAT.get(backend))))})"


def asks_the_image(config: ClusterConfig) -> bool:
    """Does the choice need to know whether Ray runs in the image (preflight's one-shot
    container on the head)?"""
    return config.vllm.backend in (AUTO, ray.BACKEND)


def choose(config: ClusterConfig, ray_path: str | None) -> tuple[str, str]:
    """(backend, why in words), given where preflight found `ray` in the image (None: it does
    not run there, or was not asked)."""
    backend = config.vllm.backend
    if backend != AUTO:
        return backend, reason(backend, "configured")
    if ray_path is None:
        return mp.BACKEND, reason(mp.BACKEND, "the image carries no Ray")
    return ray.BACKEND, reason(ray.BACKEND, f"the image carries Ray at {ray_path}")


def refusal(config: ClusterConfig, ray_path: str | None) -> str | None:
    """Why the configured backend cannot run on this image (None: it can)."""
    if config.vllm.backend != ray.BACKEND or ray_path is not None:
        return None
    return (
        f'`ray` does not run in image {config.vllm.image} (backend = "ray"); vLLM images since '
        '0.18 do not bundle Ray: set backend = "mp" (vLLM\'s own multi-node launcher, no Ray '
        "needed), or use an image that carries Ray (vLLM 0.17 or older, or one built FROM yours "
        "with `pip install ray[default]`)"
    )


def candidates(config: ClusterConfig) -> list[tuple[str, str]]:
    """What a run may launch before the image is asked (the dry run shows each)."""
    backend = config.vllm.backend
    if backend != AUTO:
        return [(backend, reason(backend, "configured"))]
    return [
        (ray.BACKEND, reason(ray.BACKEND, "if the image carries Ray")),
        (mp.BACKEND, reason(mp.BACKEND, "if the image carries no Ray")),
    ]


AUTO_NOTE = (
    "backend auto: a one-shot container of the image decides when the run starts "
    "(ray if Ray runs in it, else mp); both launches follow"
)


def assumed(config: ClusterConfig) -> str:
    """The backend when nothing runs to say which: the configured one (auto counts as ray,
    the backend our first users' images take)."""
    return ray.BACKEND if config.vllm.backend == AUTO else config.vllm.backend


def launch_fingerprint(config: ClusterConfig, backend: str | None = None) -> str:
    """The fingerprint a group of ``backend`` (default: :func:`assumed`) launched with these
    settings carries: its own members' specs, from the settings alone."""
    backend = backend or assumed(config)
    return plan_fingerprint(config, BACKENDS[backend](config, None, ""))


def plan_for(
    backend: str,
    config: ClusterConfig,
    fabric: Mapping[str, NodeFabric] | None = None,
    why: str = "",
    entrypoint: ImageEntrypoint | None = None,
) -> LaunchPlan:
    """The backend's plan for ``config`` and the image's ENTRYPOINT (kept when it runs its
    arguments), stamped with the launch fingerprint (which depends on the settings alone)."""
    built = BACKENDS[backend](config, fabric, why).for_image(entrypoint)
    return built.stamped(launch_fingerprint(config, backend))
