"""What every launch backend's containers share: names and labels, the environment (NCCL's
transport log, the fabric's interfaces and HCAs, the IP vLLM must use), the RDMA options, the
model mounts and `vllm serve`'s common arguments."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.config.launch import API_KEY_VARIABLE
from vllm_redeploy.launch.caches import cache_env, cache_mounts
from vllm_redeploy.launch.loader import configured as configured_loader
from vllm_redeploy.names import container_name
from vllm_redeploy.nccl_logging import nccl_logging
from vllm_redeploy.nodes.containers import ContainerSpec, project_labels
from vllm_redeploy.parsers.fabric import FabricFacts

LABEL_LAUNCH = "io.vllm-redeploy.launch"
LABEL_BACKEND = "io.vllm-redeploy.backend"
LABEL_LOADER = "io.vllm-redeploy.loader"  # the weight loader and why, as the run chose it
# The container that serves the API keeps this role's name on every backend.
ENGINE_ROLE = "engine"
# The RDMA devices NCCL opens (the uverbs nodes under it), as NVIDIA's containers get them.
RDMA_DEVICES = "/dev/infiniband"
# vLLM's bound on its engine's whole start, in whole seconds (read as an int).
ENGINE_READY_TIMEOUT = "VLLM_ENGINE_READY_TIMEOUT_S"
PER_NODE_VARS = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "NCCL_IB_HCA",
)


def engine_container(config: ClusterConfig) -> str:
    """The container that serves the API (the Ray engine, the mp leader)."""
    return container_name(config.name, ENGINE_ROLE)


@dataclass(frozen=True)
class NodeFabric:
    """What a node's fabric discovery (preflight) means for its containers."""

    rdma: bool = False  # its containers get the RDMA devices, IPC_LOCK and the ulimits
    ib_hca: str | None = None  # NCCL_IB_HCA: every ACTIVE HCA of the fabric port's twins
    socket_ifnames: tuple[str, ...] = ()  # the interface owning the fabric IP (and its twins)
    hcas: tuple[str, ...] = ()  # the ACTIVE HCAs (name:port), for people to read

    @classmethod
    def of(cls, facts: FabricFacts, node: NodeConfig, config: ClusterConfig) -> NodeFabric:
        hcas = tuple(f"{h.name}:{h.port}" for h in facts.nccl_hcas)
        wanted = bool(node.ib_hcas or hcas)
        rdma = config.fabric.rdma == "auto" and wanted and bool(facts.rdma_devices)
        return cls(rdma, facts.nccl_ib_hca, facts.socket_ifnames, hcas)


def node_env(
    node: NodeConfig, config: ClusterConfig, fabric: NodeFabric | None = None
) -> dict[str, str]:
    """Environment of a node's containers: the compile caches, vLLM's start-up bound and the
    model's cache, then the fabric interfaces and HCAs found on the node, then [vllm.env], then
    the node's configured interfaces and HCAs, then the IP vLLM must use. NCCL logs at least
    what the transport proof reads (:mod:`nccl_logging`). A backend adds its own defaults below
    these (Ray's: launch/ray.py), so that [vllm.env] still wins over them."""
    fabric = fabric or NodeFabric()
    env = {
        "PYTHONUNBUFFERED": "1",
        **cache_env(config),
        **engine_start_env(config),
        **config.vllm.source.env(),  # a repo id: the cache's hub, offline
    }
    if fabric.socket_ifnames:
        env |= dict.fromkeys(PER_NODE_VARS[:4], ",".join(fabric.socket_ifnames))
        # Gloo wants the same number of interfaces in every process, and twins are up on one
        # node and down on another: the fabric IP's own interface alone, as NVIDIA's playbook.
        env["GLOO_SOCKET_IFNAME"] = fabric.socket_ifnames[0]
    if fabric.ib_hca:
        env["NCCL_IB_HCA"] = fabric.ib_hca
    env.update(config.vllm.env)
    # NCCL says which transport it chose (checked after every launch), whatever [vllm.env] asks.
    env |= nccl_logging(config.vllm.env)
    if node.fabric_interfaces:
        env |= dict.fromkeys(PER_NODE_VARS[:4], ",".join(node.fabric_interfaces))
    if node.ib_hcas:
        env["NCCL_IB_HCA"] = ",".join(node.ib_hcas)
    env["VLLM_HOST_IP"] = node.ip
    return env


def api_server_env(config: ClusterConfig) -> dict[str, str]:
    """The secrets of the member that serves the API (the engine, the mp leader), by
    environment, never on its command line: the Hugging Face token, and vLLM's API key, which
    vLLM reads from VLLM_API_KEY when --api-key is not given (the configuration refuses that
    flag). A container's environment is shown by `docker inspect` to whoever may use the
    node's Docker, as HF_TOKEN always was; not by `ps`, the run's log or the dry run."""
    env = {}
    if config.secrets.hf_token is not None:
        env["HF_TOKEN"] = config.secrets.hf_token.get_secret_value()
    if config.secrets.vllm_api_key is not None:
        env[API_KEY_VARIABLE] = config.secrets.vllm_api_key.get_secret_value()
    return env


def engine_start_env(config: ClusterConfig) -> dict[str, str]:
    """vLLM's own bound on its engine's start (weights, compile, graph capture: 600 s unless
    set) raised to ours, [deadlines] model_load_s, so it never cuts short a load we would still
    wait for (a GB10's first cold start after a reboot or an image change takes about that; see
    vllm#48031). Its clock starts after the API server's imports, later than ours: our wait
    gives up first, with its own diagnosis. [vllm.env] may still set it."""
    return {ENGINE_READY_TIMEOUT: str(math.ceil(config.deadlines.model_load_s))}


def rdma_options(config: ClusterConfig, fabric: NodeFabric | None) -> dict[str, object]:
    """What a container needs to open the node's HCAs (NCCL falls back to TCP without it):
    the devices, IPC_LOCK, an unlimited memlock and NVIDIA's stack limit. Nodes without RDMA
    get none of it; ``privileged`` only when configured."""
    options: dict[str, object] = {"privileged": config.fabric.privileged}
    if fabric is not None and fabric.rdma:
        options |= {
            "devices": [RDMA_DEVICES],
            "cap_add": ["IPC_LOCK"],
            "ulimits": {
                "memlock": config.fabric.memlock_bytes,
                "stack": config.fabric.stack_bytes,
            },
        }
    return options


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(entrypoint, command) that make a container run exactly ``argv``, whatever the image.

    Docker appends a container's command to the image's ENTRYPOINT: `vllm/vllm-openai` declares
    ``["vllm", "serve"]``, so ``ray start`` alone would run as ``vllm serve ray start``; NGC
    images start a banner script. So every container we start names its program itself.
    """
    if not argv:
        raise ValueError("a container needs a program to run")
    return [argv[0]], list(argv[1:])


def container_argv(spec: ContainerSpec) -> list[str]:
    """What runs in a container of ours: its entrypoint, then its command."""
    return [*(spec.entrypoint or ()), *spec.command]


def model_mounts(config: ClusterConfig) -> list[str]:
    """The model (read-only), the compile caches, then the configured mounts."""
    return [
        config.vllm.source.mount(),  # a snapshot's links resolve in its models-- directory
        *cache_mounts(config),
        *config.vllm.volumes,
    ]


def group_spec(
    config: ClusterConfig,
    *,
    name: str,
    role: str,
    backend: str,
    argv: Sequence[str],
    env: dict[str, str],
    fabric: NodeFabric | None,
    volumes: list[str] | None = None,
    **docker: object,
) -> ContainerSpec:
    """A container of the group: the configured image running exactly ``argv``, labelled with
    its role and backend, with the model mounted, the GPUs, shared memory and RDMA options."""
    entrypoint, command = split_argv(argv)
    return ContainerSpec(
        name=name,
        image=config.vllm.image,
        entrypoint=entrypoint,
        command=command,
        env=env,
        volumes=model_mounts(config) if volumes is None else volumes,
        labels={**project_labels(config.name, role), LABEL_BACKEND: backend},
        shm_size=config.vllm.shm_size,
        gpus=-1 if config.vllm.gpu_device_request else None,
        **rdma_options(config, fabric),  # type: ignore[arg-type]
        **docker,  # type: ignore[arg-type]
    )


def serve_args(config: ClusterConfig, executor: str | None = None) -> list[str]:
    """`vllm serve` with what every backend passes; the configured extra arguments not yet."""
    v = config.vllm
    args = ["vllm", "serve", v.source.serve]
    args += ["--tensor-parallel-size", str(v.tensor_parallel_size)]
    args += ["--pipeline-parallel-size", str(v.pipeline_parallel_size)]
    if executor:
        args += ["--distributed-executor-backend", executor]
    args += ["--host", v.host, "--port", str(v.port)]
    if v.served_model_name:
        args += ["--served-model-name", v.served_model_name]
    if v.reasoning_parser:
        args += ["--reasoning-parser", v.reasoning_parser]
    if v.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{v.gpu_memory_utilization:g}"]
    if v.max_model_len is not None:
        args += ["--max-model-len", str(v.max_model_len)]
    if loader := configured_loader(config):
        args += ["--load-format", loader]
    return args
