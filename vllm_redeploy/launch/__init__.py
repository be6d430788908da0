"""How the group is launched: one ``LaunchPlan`` shape (plan.py), what a backend is
(backend.py), what every backend's containers share (group.py), the backends (ray.py, mp.py),
and their registry with the one rule that picks one (choose.py); what the image's vLLM says of
itself (image_vllm.py) and the weight loader chosen from it (loader.py)."""

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
    LABEL_LOADER,
    NodeFabric,
    container_argv,
    engine_container,
    node_env,
)
from vllm_redeploy.launch.image_vllm import ImageVllm
from vllm_redeploy.launch.loader import Loader, choose_loader, loader_refusal, planned_words
from vllm_redeploy.launch.plan import LaunchPlan, Member, Phase

__all__ = [
    "ENGINE_ROLE",
    "LABEL_BACKEND",
    "LABEL_LAUNCH",
    "LABEL_LOADER",
    "ImageEntrypoint",
    "ImageVllm",
    "LaunchPlan",
    "Loader",
    "Member",
    "NodeFabric",
    "Phase",
    "asks_the_image",
    "assumed",
    "candidates",
    "choose",
    "choose_loader",
    "container_argv",
    "engine_container",
    "launch_fingerprint",
    "loader_refusal",
    "node_env",
    "plan_for",
    "planned_words",
    "refusal",
]
