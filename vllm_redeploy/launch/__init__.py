"""How the group is launched: one ``LaunchPlan`` shape (plan.py), what a backend is
(backend.py), what every backend's containers share (group.py), the backends (ray.py, mp.py),
and their registry with the one rule that picks one (choose.py)."""

from vllm_redeploy.launch.choose import (
    asks_the_image,
    assumed,
    candidates,
    choose,
    launch_fingerprint,
    plan_for,
    refusal,
)
from vllm_redeploy.launch.entrypoint import ImageEntrypoint
from vllm_redeploy.launch.group import (
    ENGINE_ROLE,
    LABEL_BACKEND,
    LABEL_LAUNCH,
    NodeFabric,
    container_argv,
    engine_container,
    node_env,
)
from vllm_redeploy.launch.plan import LaunchPlan, Member, Phase

__all__ = [
    "ENGINE_ROLE",
    "LABEL_BACKEND",
    "LABEL_LAUNCH",
    "ImageEntrypoint",
    "LaunchPlan",
    "Member",
    "NodeFabric",
    "Phase",
    "asks_the_image",
    "assumed",
    "candidates",
    "choose",
    "container_argv",
    "engine_container",
    "launch_fingerprint",
    "node_env",
    "plan_for",
    "refusal",
]
