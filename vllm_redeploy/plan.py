"""What runs where: the Ray and vLLM containers of a cluster, derived from the configuration.

Pure data, so the flow launches exactly what ``--dry-run`` prints.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.docker import ContainerSpec, project_labels

RAY_ROLE = "ray"
ENGINE_ROLE = "engine"
# The engine is a Ray driver: it finds the local raylet among the processes it can see and talks
# to it through sockets in Ray's session directory. So the engine container shares the head Ray
# container's PID namespace, and that directory through a Docker volume of ours.
RAY_TMP = "/tmp/ray"  # noqa: S108 - a path inside our containers, not on the host
# vLLM copies the driver's NCCL_*/UCX_*/... variables to every Ray worker; this file lists
# those it must not copy (read from VLLM_CONFIG_ROOT inside the engine container).
VLLM_CONFIG_ROOT = "/tmp/vllm-redeploy-config"  # noqa: S108 - inside the engine container
PER_NODE_VARS = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "NCCL_IB_HCA",
)


def ray_container(config: ClusterConfig) -> str:
    return container_name(config.name, RAY_ROLE)


def engine_container(config: ClusterConfig) -> str:
    return container_name(config.name, ENGINE_ROLE)


def ray_volume(config: ClusterConfig) -> str:
    return container_name(config.name, "ray-tmp")


def node_env(node: NodeConfig, config: ClusterConfig) -> dict[str, str]:
    """Environment of a node's containers: the IP vLLM must use and the fabric interfaces."""
    env = dict(config.vllm.env)
    env["VLLM_HOST_IP"] = node.ip
    if node.fabric_interfaces:
        names = ",".join(node.fabric_interfaces)
        for var in PER_NODE_VARS[:4]:
            env[var] = names
    if node.ib_hcas:
        env["NCCL_IB_HCA"] = ",".join(node.ib_hcas)
    return env


def _mounts(config: ClusterConfig) -> list[str]:
    return [f"{config.vllm.model}:{config.vllm.model}:ro", *config.vllm.volumes]


def _gpus(config: ClusterConfig) -> int | None:
    return -1 if config.vllm.gpu_device_request else None


def ray_start_args(node: NodeConfig, config: ClusterConfig) -> list[str]:
    head = config.head
    args = [
        "ray",
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={node.ip}",
        f"--num-gpus={node.gpus}",
    ]
    if node is head:
        # No dashboard: vLLM does not need it, it costs seconds at every start, and its job API
        # runs code for anyone who reaches it. ray.extra_args can turn it back on.
        args += ["--head", f"--port={config.ray.port}", "--include-dashboard=false"]
    else:
        args += [f"--address={head.ip}:{config.ray.port}"]
    return [*args, *config.ray.extra_args]


def ray_spec(node: NodeConfig, config: ClusterConfig) -> ContainerSpec:
    volumes = _mounts(config)
    if node is config.head:
        volumes.append(f"{ray_volume(config)}:{RAY_TMP}")
    return ContainerSpec(
        name=ray_container(config),
        image=config.vllm.image,
        command=ray_start_args(node, config),
        env=node_env(node, config),
        volumes=volumes,
        labels=project_labels(config.name, RAY_ROLE),
        shm_size=config.vllm.shm_size,
        gpus=_gpus(config),
    )


def vllm_serve_args(config: ClusterConfig) -> list[str]:
    v = config.vllm
    args = [
        "vllm",
        "serve",
        v.model,
        "--tensor-parallel-size",
        str(v.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(v.pipeline_parallel_size),
        "--distributed-executor-backend",
        "ray",
        "--host",
        v.host,
        "--port",
        str(v.port),
    ]
    if v.served_model_name:
        args += ["--served-model-name", v.served_model_name]
    if v.reasoning_parser:
        args += ["--reasoning-parser", v.reasoning_parser]
    if v.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{v.gpu_memory_utilization:g}"]
    if v.max_model_len is not None:
        args += ["--max-model-len", str(v.max_model_len)]
    return [*args, *v.extra_args]


def interfaces_differ(config: ClusterConfig) -> bool:
    kinds = {(tuple(n.fabric_interfaces), tuple(n.ib_hcas)) for n in config.nodes}
    return len(kinds) > 1


def engine_spec(config: ClusterConfig) -> ContainerSpec:
    head = config.head
    env = node_env(head, config)
    env["RAY_ADDRESS"] = f"{head.ip}:{config.ray.port}"
    command = vllm_serve_args(config)
    if interfaces_differ(config):
        # Per-node interface names differ: keep the head's off the copy to the workers.
        env["VLLM_CONFIG_ROOT"] = VLLM_CONFIG_ROOT
        exclude = json.dumps(list(PER_NODE_VARS))
        target = f"{VLLM_CONFIG_ROOT}/ray_non_carry_over_env_vars.json"
        script = 'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1" && shift 2 && exec "$@"'
        command = ["sh", "-c", script, "sh", target, exclude, *command]
    if config.secrets.hf_token is not None:
        env["HF_TOKEN"] = config.secrets.hf_token.get_secret_value()
    return ContainerSpec(
        name=engine_container(config),
        image=config.vllm.image,
        command=command,
        env=env,
        volumes=[*_mounts(config), f"{ray_volume(config)}:{RAY_TMP}"],
        labels=project_labels(config.name, ENGINE_ROLE),
        shm_size=config.vllm.shm_size,
        gpus=_gpus(config),
        pid_mode=f"container:{ray_container(config)}",
    )


# Run in the head's Ray container: which nodes are alive, where, with what GPUs. It asks the GCS
# directly (a fraction of a second); a Ray without that client falls back to a driver (seconds).
RAY_MEMBERS_SCRIPT = """\
import json, sys
try:
    from ray._raylet import GcsClient
    nodes = GcsClient(address=sys.argv[1]).get_all_node_info().values()
    members = [
        {"ip": n.node_manager_address, "alive": n.state == 0,
         "gpus": dict(n.resources_total).get("GPU", 0)}
        for n in nodes
    ]
except (ImportError, AttributeError, TypeError):
    import ray
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    members = [
        {"ip": n["NodeManagerAddress"], "alive": n["Alive"],
         "gpus": n.get("Resources", {}).get("GPU", 0)}
        for n in ray.nodes()
    ]
print(json.dumps(members))
"""


def ray_members_argv(config: ClusterConfig) -> list[str]:
    """The command, in the head's Ray container, that prints the Ray members as JSON."""
    return ["python3", "-c", RAY_MEMBERS_SCRIPT, f"{config.head.ip}:{config.ray.port}"]


@dataclass(frozen=True)
class RayMember:
    ip: str
    alive: bool
    gpus: float


def parse_members(stdout: str) -> list[RayMember]:
    line = stdout.strip().splitlines()[-1] if stdout.strip() else "[]"
    return [RayMember(m["ip"], bool(m["alive"]), float(m["gpus"])) for m in json.loads(line)]


LABEL_LAUNCH = "io.vllm-redeploy.launch"


def launch_fingerprint(config: ClusterConfig) -> str:
    """A digest of everything that shapes the deployment, secrets left out: if the running
    engine carries another one, the settings changed and `ensure` redeploys."""
    specs = [engine_spec(config), *(ray_spec(n, config) for n in config.nodes)]
    secrets = set(config.secret_values())
    data = [
        {
            "image": s.image,
            "command": list(s.command),
            "env": {k: v for k, v in sorted(s.env.items()) if v not in secrets},
            "volumes": list(s.volumes),
            "shm": s.shm_size,
            "gpus": s.gpus,
        }
        for s in specs
    ]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def membership_problems(config: ClusterConfig, members: list[RayMember]) -> list[str]:
    """What is wrong with Ray's membership, one phrase per node (empty when complete)."""
    alive = {m.ip: m for m in members if m.alive}
    problems = []
    for node in config.nodes:
        member = alive.get(node.ip)
        if member is None:
            problems.append(f"{node.name} is not in the cluster at {node.ip}")
        elif member.gpus < node.gpus:
            problems.append(f"{node.name} brings {member.gpus:g} GPUs, expected {node.gpus}")
    strangers = sorted(set(alive) - {n.ip for n in config.nodes})
    if strangers:
        problems.append(
            "Ray has nodes at unexpected IPs "
            + ", ".join(strangers)
            + " (a node registered another address than its fabric_ip)"
        )
    return problems
