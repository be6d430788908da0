"""What runs where: the containers of a cluster's group, derived from the configuration and what
preflight found on the nodes (``NodeFabric``).

One shape for every launch backend: a ``LaunchPlan`` lists the group's containers (``Member``:
node, role, phase, spec), names the one that serves the API, and is what the flow launches, what
wait-ready watches and what ``--dry-run`` prints. This module builds the Ray backend's plan
(a Ray head, a Ray worker per other node, the engine on the head); ``plan_mp`` builds vLLM's own
multi-node launcher's. Pure data, so the flow launches exactly what ``--dry-run`` prints.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.docker import ContainerSpec, project_labels
from vllm_redeploy.parsers.fabric import FabricFacts

Backend = Literal["ray", "mp"]
LABEL_LAUNCH = "io.vllm-redeploy.launch"
LABEL_BACKEND = "io.vllm-redeploy.backend"

RAY_ROLE = "ray"
ENGINE_ROLE = "engine"
# The RDMA devices NCCL opens (the uverbs nodes under it), as NVIDIA's containers get them.
RDMA_DEVICES = "/dev/infiniband"
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
    """Environment of a node's containers: NCCL's transport log and Ray's defaults for unified
    memory, then the fabric interfaces and HCAs found on the node, then [vllm.env], then the
    node's configured interfaces and HCAs, then the IP vLLM must use."""
    fabric = fabric or NodeFabric()
    env = {
        # NCCL says which transport it chose (checked after every launch); kept short.
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        # Every rank's lines reach the engine's log: Ray would fold the workers' look-alike ones.
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
        **_ray_memory_env(config),
    }
    if "NCCL_DEBUG" in config.vllm.env:  # the operator's own NCCL logging
        del env["NCCL_DEBUG_SUBSYS"]
    if fabric.socket_ifnames:
        env |= dict.fromkeys(PER_NODE_VARS[:4], ",".join(fabric.socket_ifnames))
        # Gloo wants the same number of interfaces in every process, and twins are up on one
        # node and down on another: the fabric IP's own interface alone, as NVIDIA's playbook.
        env["GLOO_SOCKET_IFNAME"] = fabric.socket_ifnames[0]
    if fabric.ib_hca:
        env["NCCL_IB_HCA"] = fabric.ib_hca
    env.update(config.vllm.env)
    if node.fabric_interfaces:
        env |= dict.fromkeys(PER_NODE_VARS[:4], ",".join(node.fabric_interfaces))
    if node.ib_hcas:
        env["NCCL_IB_HCA"] = ",".join(node.ib_hcas)
    env["VLLM_HOST_IP"] = node.ip
    return env


def _ray_memory_env(config: ClusterConfig) -> dict[str, str]:
    """Ray's defaults that do harm on unified memory, turned off unless configured on."""
    env = {}
    if not config.ray.memory_monitor:
        env["RAY_memory_monitor_refresh_ms"] = "0"
    if not config.ray.prestart_workers:
        env["RAY_enable_worker_prestart"] = "0"
        env["RAY_prestart_worker_first_driver"] = "0"
    return env


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
    return [f"{config.vllm.model}:{config.vllm.model}:ro", *config.vllm.volumes]


def gpus_request(config: ClusterConfig) -> int | None:
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
    if config.ray.object_store_bytes is not None:
        args.append(f"--object-store-memory={config.ray.object_store_bytes}")
    if node is head:
        # No dashboard: vLLM does not need it, it costs seconds at every start, and its job API
        # runs code for anyone who reaches it. ray.extra_args can turn it back on.
        args += ["--head", f"--port={config.ray.port}", "--include-dashboard=false"]
    else:
        args += [f"--address={head.ip}:{config.ray.port}"]
    return [*args, *config.ray.extra_args]


def ray_spec(
    node: NodeConfig, config: ClusterConfig, fabric: NodeFabric | None = None
) -> ContainerSpec:
    volumes = model_mounts(config)
    if node is config.head:
        volumes.append(f"{ray_volume(config)}:{RAY_TMP}")
    entrypoint, command = split_argv(ray_start_args(node, config))
    return ContainerSpec(
        name=ray_container(config),
        image=config.vllm.image,
        entrypoint=entrypoint,
        command=command,
        env=node_env(node, config, fabric),
        volumes=volumes,
        labels={**project_labels(config.name, RAY_ROLE), LABEL_BACKEND: "ray"},
        shm_size=config.vllm.shm_size,
        gpus=gpus_request(config),
        **rdma_options(config, fabric),  # type: ignore[arg-type]
    )


# Ray must run in the image, not merely be a file on PATH: `ray --version` imports the package.
RAY_CHECK_ARGV = ("sh", "-c", "command -v ray && ray --version")


def ray_check_spec(config: ClusterConfig) -> ContainerSpec:
    """A one-shot container of the image on the head: prints where `ray` is and its version,
    and fails when Ray does not run there."""
    entrypoint, command = split_argv(RAY_CHECK_ARGV)
    return replace(
        ray_spec(config.head, config),
        name=f"{ray_container(config)}-check",
        entrypoint=entrypoint,
        command=command,
        volumes=list(config.vllm.volumes),
        gpus=None,
    )


def vllm_serve_args(config: ClusterConfig) -> list[str]:
    """`vllm serve` on the Ray backend: one engine on the head, its workers placed by Ray."""
    return [*serve_args(config, executor="ray"), *config.vllm.extra_args]


def serve_args(config: ClusterConfig, executor: str | None = None) -> list[str]:
    """`vllm serve` with what every backend passes; the configured extra arguments not yet."""
    v = config.vllm
    args = ["vllm", "serve", v.model]
    args += ["--tensor-parallel-size", str(v.tensor_parallel_size)]
    args += ["--pipeline-parallel-size", str(v.pipeline_parallel_size)]
    if executor:
        args += ["--distributed-executor-backend", executor]
    args += [
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
    return args


def per_node_values_differ(config: ClusterConfig, fabric: Mapping[str, NodeFabric]) -> bool:
    """Do the nodes' interface and HCA variables differ (names depend on the port cabled)?"""
    envs = [
        {k: v for k, v in node_env(n, config, fabric.get(n.name)).items() if k in PER_NODE_VARS}
        for n in config.nodes
    ]
    return any(env != envs[0] for env in envs)


def engine_spec(
    config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None = None
) -> ContainerSpec:
    """The engine on the head, a Ray driver of the cluster (``fabric``: what every node has)."""
    fabric = fabric or {}
    head = config.head
    env = node_env(head, config, fabric.get(head.name))
    env["RAY_ADDRESS"] = f"{head.ip}:{config.ray.port}"
    argv = vllm_serve_args(config)
    if per_node_values_differ(config, fabric):
        # vLLM copies the driver's NCCL_*/UCX_* variables to every worker; each node's own
        # interfaces and HCAs are in its Ray container already: keep the head's off the copy.
        env["VLLM_CONFIG_ROOT"] = VLLM_CONFIG_ROOT
        exclude = json.dumps(list(PER_NODE_VARS))
        target = f"{VLLM_CONFIG_ROOT}/ray_non_carry_over_env_vars.json"
        script = 'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1" && shift 2 && exec "$@"'
        argv = ["sh", "-c", script, "sh", target, exclude, *argv]
    if config.secrets.hf_token is not None:
        env["HF_TOKEN"] = config.secrets.hf_token.get_secret_value()
    entrypoint, command = split_argv(argv)
    return ContainerSpec(
        name=engine_container(config),
        image=config.vllm.image,
        entrypoint=entrypoint,
        command=command,
        env=env,
        volumes=[*model_mounts(config), f"{ray_volume(config)}:{RAY_TMP}"],
        labels={**project_labels(config.name, ENGINE_ROLE), LABEL_BACKEND: "ray"},
        shm_size=config.vllm.shm_size,
        gpus=gpus_request(config),
        pid_mode=f"container:{ray_container(config)}",
        **rdma_options(config, fabric.get(head.name)),  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Member:
    """One container of the group: where, in which launch phase, doing what."""

    node: str
    role: str  # ray-head, ray-worker, engine (Ray); leader, follower (mp)
    phase: int  # launched in ascending phase order; one phase's members together
    spec: ContainerSpec
    serves_api: bool = False


@dataclass(frozen=True)
class LaunchPlan:
    """The group a run launches, and how to read it while it loads and serves."""

    backend: Backend
    reason: str  # why this backend, for people
    members: tuple[Member, ...]
    fingerprint: str
    fabric: Mapping[str, NodeFabric] = field(default_factory=dict)

    @property
    def api(self) -> Member:
        """The member that serves the OpenAI-compatible API (its log has the load progress)."""
        return next(m for m in self.members if m.serves_api)

    def phase(self, number: int) -> list[Member]:
        return [m for m in self.members if m.phase == number]

    def on(self, node: str) -> list[Member]:
        return [m for m in self.members if m.node == node]

    @property
    def rank_logs(self) -> list[Member]:
        """Whose logs hold every rank's NCCL lines: with Ray, the engine's (Ray forwards the
        workers' output to the driver); with mp, each node's own."""
        return [self.api] if self.backend == "ray" else list(self.members)


def ray_plan(
    config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None = None, reason: str = ""
) -> LaunchPlan:
    """A Ray head on the head node, a Ray worker on every other, then the engine (a Ray driver)
    on the head, in three phases."""
    fabric = fabric or {}
    head = config.head
    members = [Member(head.name, "ray-head", 0, ray_spec(head, config, fabric.get(head.name)))]
    members += [
        Member(n.name, "ray-worker", 1, ray_spec(n, config, fabric.get(n.name)))
        for n in config.workers
    ]
    members.append(Member(head.name, ENGINE_ROLE, 2, engine_spec(config, fabric), True))
    return stamped_plan("ray", reason, members, config, fabric)


def stamped_plan(
    backend: Backend,
    reason: str,
    members: Sequence[Member],
    config: ClusterConfig,
    fabric: Mapping[str, NodeFabric],
) -> LaunchPlan:
    """The plan, every container labelled with the configuration's launch fingerprint (what
    `ensure` and `status` compare with the configuration later)."""
    fingerprint = launch_fingerprint(config)
    members = [
        replace(m, spec=replace(m.spec, labels={**m.spec.labels, LABEL_LAUNCH: fingerprint}))
        for m in members
    ]
    return LaunchPlan(backend, reason, tuple(members), fingerprint, dict(fabric))


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


def launch_fingerprint(config: ClusterConfig) -> str:
    """A digest of everything in the configuration that shapes the deployment, secrets left out:
    if the running engine carries another one, the settings changed and `ensure` redeploys.
    (What preflight discovers on the nodes is not in it: the same settings mean the same digest.)
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
