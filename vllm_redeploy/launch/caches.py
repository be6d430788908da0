"""What vLLM builds at start, kept between starts: one directory per node ([cache] dir), mounted
at the same path into every container of the group, and the variables that point each builder's
cache into it.

Without it, every start of a new container compiles again: torch.compile's graphs and Inductor's
kernels (vLLM keeps them under VLLM_CACHE_ROOT), Triton's kernels, FlashInfer's JIT modules and
the driver's PTX cache, minutes on a DGX Spark. Docker creates a missing directory as root, which
is what vLLM's images run as; an image with another USER gets the directory handed to that user
first (``cache_owner``, the flow's cache-dir step). The operator's own [vllm.env] values win over
these (node_env).
"""

from __future__ import annotations

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec, project_labels
from vllm_redeploy.parsers.vllm_log import CompileCache

ROOT_NAMES = ("", "root", "0")

DEFAULT_ROOT = "/var/cache/vllm-redeploy"
# Each variable and its subdirectory. FLASHINFER_WORKSPACE_BASE is a base: FlashInfer appends
# .cache/flashinfer/<arch> to it.
CACHE_VARS = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TVM_FFI_CACHE_DIR": "tvm-ffi",
    "TORCH_EXTENSIONS_DIR": "torch-extensions",
    "CUDA_CACHE_PATH": "cuda",
}


def cache_dir(config: ClusterConfig) -> str | None:
    """The cache directory on every node, or None when caching is off."""
    if not config.cache.enabled:
        return None
    return config.cache.dir or f"{DEFAULT_ROOT}/{config.name}"


def cache_mounts(config: ClusterConfig) -> list[str]:
    path = cache_dir(config)
    return [] if path is None else [f"{path}:{path}"]


def cache_env(config: ClusterConfig) -> dict[str, str]:
    path = cache_dir(config)
    if path is None:
        return {}
    return {var: f"{path}/{sub}" for var, sub in CACHE_VARS.items()}


def cache_owner(config: ClusterConfig, image_user: str | None) -> str | None:
    """The user the cache directory must be handed to, or None when Docker's root-owned one
    does (the cache is off, or the image runs as root)."""
    if cache_dir(config) is None or image_user is None:
        return None
    return None if image_user.split(":", 1)[0] in ROOT_NAMES else image_user


def own_cache_spec(config: ClusterConfig, user: str) -> ContainerSpec:
    """A one-shot container of the image, as root, that hands the node's cache directory (made
    by Docker for the mount) to ``user``, resolved by the image's own /etc/passwd."""
    path = cache_dir(config)
    assert path is not None
    return ContainerSpec(
        name=container_name(config.name, "cache-dir"),
        image=config.vllm.image,
        entrypoint=["chown"],
        command=[user, path],
        volumes=[f"{path}:{path}"],
        labels=project_labels(config.name, "cache-dir"),
        user="0",
    )


def compile_cache_words(config: ClusterConfig, state: CompileCache | None) -> str:
    """For the summary: where the caches are, and what this start did with them."""
    path = cache_dir(config)
    where = f"`{path}` on every node" if path else "off ([cache] enabled = false)"
    if state is None:
        return f"{where}; the engine did not use torch.compile (eager mode)"
    return f"{where}; this start: {state.summary()}"
