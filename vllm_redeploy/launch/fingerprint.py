"""The launch fingerprint: which settings the running group was started with."""

from __future__ import annotations

import hashlib
import json

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch.ray import engine_spec, ray_spec


def launch_fingerprint(config: ClusterConfig) -> str:
    """A digest of everything in the configuration that shapes the deployment, secrets left out:
    if the running engine carries another one, the settings changed and `ensure` redeploys.
    (What preflight discovers on the nodes is not in it: the same settings mean the same digest.)

    It digests the Ray backend's container specs whatever the backend (they hold every setting
    both backends read, and the backend is in the digest), so groups started before the mp
    backend existed keep being recognised. Whether vLLM's API key is set is in it (an engine
    started without one answers keyed requests too); the key is not (an engine started with
    another one answers 401, which `ensure` redeploys).
    """
    specs = [engine_spec(config), *(ray_spec(n, config) for n in config.nodes)]
    secrets = set(config.secret_values())
    data = [
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
