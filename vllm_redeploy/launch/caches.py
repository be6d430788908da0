"""What vLLM builds at start, kept between starts: one directory per node ([cache] dir), mounted
at the same path into every container of the group, and the variables that point each builder's
cache into it.

Without it, every start of a new container compiles again: torch.compile's graphs and Inductor's
kernels (vLLM keeps them under VLLM_CACHE_ROOT), Triton's kernels, FlashInfer's JIT modules and
the driver's PTX cache, minutes on a DGX Spark. Docker creates a missing directory as root, which
is what vLLM's images run as. The operator's own [vllm.env] values win over these (node_env).
"""

from __future__ import annotations

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.parsers.vllm_log import CompileCache

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


def compile_cache_words(config: ClusterConfig, state: CompileCache | None) -> str:
    """For the summary: where the caches are, and what this start did with them."""
    path = cache_dir(config)
    where = f"`{path}` on every node" if path else "off ([cache] enabled = false)"
    if state is None:
        return f"{where}; the engine did not use torch.compile (eager mode)"
    return f"{where}; this start: {state.summary()}"
