"""The launch fingerprint: which settings the running group was started with."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch import ray
from vllm_redeploy.launch.plan import LaunchPlan
from vllm_redeploy.launch.ray import engine_spec, ray_spec
from vllm_redeploy.nodes.containers import ContainerSpec


def plan_fingerprint(config: ClusterConfig, plan: LaunchPlan) -> str:
    """A digest of everything in the configuration that shapes the group, secrets left out: if
    the running API member carries another one, the settings changed and `ensure` redeploys.

    ``plan`` is the backend's plan from the settings alone (no fabric facts, no image
    ENTRYPOINT: what preflight discovers on the nodes is not in it, so the same settings mean
    the same digest), and only its members' specs are digested: a setting only another backend
    reads changes nothing. The API's member comes first, then the rest in node order, which for
    Ray is the order every fingerprint had before each backend digested its own (Ray's groups
    keep being recognised). Whether vLLM's API key is set is in it (an engine started without
    one answers keyed requests too); the key is not (an engine started with another one answers
    401, which `ensure` redeploys).
    """
    api = plan.api
    return _digest(config, [api.spec, *(m.spec for m in plan.members if m is not api)])


def ray_era_fingerprint(config: ClusterConfig) -> str:
    """What every group was stamped with while the digest took Ray's specs whatever the
    backend: an mp group started then carries it, and is told apart from one whose settings
    changed."""
    return _digest(config, [engine_spec(config), *(ray_spec(n, config) for n in config.nodes)])


def launch_changed(config: ClusterConfig, plan: LaunchPlan, carried: str | None) -> str:
    """Why a running API member's fingerprint ``carried`` is not ``plan``'s, in words."""
    if plan.backend != ray.BACKEND and carried == ray_era_fingerprint(config):
        return (
            "was started by an earlier vllm-redeploy, whose fingerprint took Ray's settings "
            f"whatever the backend; {plan.backend}'s own settings are compared from the next "
            "launch on (once)"
        )
    return "runs with other settings than the configuration's (it changed since the launch)"


def _digest(config: ClusterConfig, specs: list[ContainerSpec]) -> str:
    secrets = set(config.secret_values())
    data: list[dict[str, Any]] = [
        {
            "image": s.image,
            "entrypoint": list(s.entrypoint or ()),
            "command": list(s.command),
            "env": {k: v for k, v in sorted(s.env.items()) if v not in secrets},
            "volumes": list(s.volumes),
            "shm": s.shm_size,
            "gpus": s.gpus,
            "privileged": s.privileged,
        }
        for s in specs
    ]
    data.append({"fabric": config.fabric.model_dump(), "backend": config.vllm.backend})
    if config.secrets.vllm_api_key is not None:
        # Whether the API wants a key, never the key: an engine started without one would
        # answer our requests all the same, and `ensure` would leave it open.
        data.append({"api_key": True})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
