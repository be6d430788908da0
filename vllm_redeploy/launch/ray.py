"""The Ray backend: a Ray head on the head node, a Ray worker on every other (each pinned to its
fabric IP), then `vllm serve` on the head as a Ray driver whose workers Ray places."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.launch.backend import Backend, GroupMember, GroupStatus
from vllm_redeploy.launch.group import (
    ENGINE_ROLE,
    PER_NODE_VARS,
    NodeFabric,
    api_server_env,
    engine_container,
    group_spec,
    model_mounts,
    node_env,
    serve_args,
)
from vllm_redeploy.launch.plan import LAUNCH_VLLM, LaunchPlan, Member, Phase, Settle
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec
from vllm_redeploy.nodes.docker import NodeDocker
from vllm_redeploy.nodes.errors import RemoteError
from vllm_redeploy.safe_text import fenced, one_line

BACKEND = "ray"
RAY_ROLE = "ray"
# The engine is a Ray driver: it finds the local raylet among the processes it can see and talks
# to it through sockets in Ray's session directory. So the engine container shares the head Ray
# container's PID namespace, and that directory through a Docker volume of ours.
RAY_TMP = "/tmp/ray"  # noqa: S108 - a path inside our containers, not on the host
# vLLM copies the driver's NCCL_*/UCX_*/... variables to every Ray worker; this file lists
# those it must not copy (read from VLLM_CONFIG_ROOT inside the engine container).
VLLM_CONFIG_ROOT = "/tmp/vllm-redeploy-config"  # noqa: S108 - inside the engine container
# Ray must run in the image, not merely be a file on PATH: `ray --version` imports the package.
RAY_CHECK_ARGV = ("sh", "-c", "command -v ray && ray --version")
MEMBERS_TIMEOUT_S = 60.0
GCS_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"


def ray_container(config: ClusterConfig) -> str:
    return container_name(config.name, RAY_ROLE)


def ray_volume(config: ClusterConfig) -> str:
    return container_name(config.name, "ray-tmp")


def plan(
    config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None = None, reason: str = ""
) -> LaunchPlan:
    """The Ray head, then the workers, then Ray's own check that it sees every node and GPU,
    then the engine: four steps of the runbook. The workers start right after the head's
    container, not after the head is up: `ray start --address` waits for the head's GCS by
    itself (RAY_gcs_server_port_wait_time_s, set to the cluster deadline), so the two starts
    overlap instead of adding up (about 3 s each)."""
    fabric = fabric or {}
    head = config.head
    phases = (
        Phase("ray-head"),
        Phase("join-workers"),
        Phase("cluster-check", "ray-members"),
        Phase(LAUNCH_VLLM),
    )
    head_spec = ray_spec(head, config, fabric.get(head.name))
    members = [Member(head.name, "ray-head", 0, head_spec, "the Ray head container")]
    members += [
        Member(
            n.name, "ray-worker", 1, ray_spec(n, config, fabric.get(n.name)), "the Ray container"
        )
        for n in config.workers
    ]
    engine = engine_spec(config, fabric)
    members.append(Member(head.name, ENGINE_ROLE, 3, engine, "the vLLM engine", serves_api=True))
    ports = ((config.vllm.port, "API port"), (config.ray.port, "Ray port"))
    return LaunchPlan(
        BACKEND, reason, phases, tuple(members), ports, ranks_log_to_api=True, fabric=dict(fabric)
    )


def ray_env(node: NodeConfig, config: ClusterConfig, fabric: NodeFabric | None) -> dict[str, str]:
    """A node's environment in Ray's containers: Ray's defaults first, so that [vllm.env] (in
    the node's environment) still wins over them."""
    defaults = {
        # Every rank's lines reach the engine's log: Ray would fold the workers' look-alike ones.
        "RAY_DEDUP_LOGS": "0",
        **_ray_memory_env(config),
    }
    return {**defaults, **node_env(node, config, fabric)}


def _ray_memory_env(config: ClusterConfig) -> dict[str, str]:
    """Ray's defaults that do harm on unified memory, turned off unless configured on."""
    env = {}
    if not config.ray.memory_monitor:
        env["RAY_memory_monitor_refresh_ms"] = "0"
    if not config.ray.prestart_workers:
        env["RAY_enable_worker_prestart"] = "0"
        env["RAY_prestart_worker_first_driver"] = "0"
    return env


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
    return group_spec(
        config,
        name=ray_container(config),
        role=RAY_ROLE,
        backend=BACKEND,
        argv=ray_start_args(node, config),
        env={**ray_env(node, config, fabric), **_gcs_wait_env(config)},
        fabric=fabric,
        volumes=volumes,
    )


def _gcs_wait_env(config: ClusterConfig) -> dict[str, str]:
    """How long `ray start` waits for the head's GCS (Ray's default is about 20 s), unless the
    operator set it: the cluster's own deadline, so a slow head is the cluster check's to name."""
    if GCS_WAIT_VAR in config.vllm.env:
        return {}
    return {GCS_WAIT_VAR: f"{config.deadlines.ray_cluster_s:.0f}"}


def ray_check_spec(config: ClusterConfig) -> ContainerSpec:
    """A one-shot container of the image on the head: prints where `ray` is and its version,
    and fails when Ray does not run there."""
    check = group_spec(
        config,
        name=f"{ray_container(config)}-check",
        role=RAY_ROLE,
        backend=BACKEND,
        argv=RAY_CHECK_ARGV,
        env=ray_env(config.head, config, None),
        fabric=None,
        volumes=list(config.vllm.volumes),
    )
    return replace(check, gpus=None)


def vllm_serve_args(config: ClusterConfig) -> list[str]:
    """`vllm serve` on the Ray backend: one engine on the head, its workers placed by Ray."""
    return [*serve_args(config, executor="ray"), *config.vllm.extra_args]


def per_node_values_differ(config: ClusterConfig, fabric: Mapping[str, NodeFabric]) -> bool:
    """Do the nodes' interface and HCA variables differ (names depend on the port cabled)?"""
    envs = [
        {k: v for k, v in ray_env(n, config, fabric.get(n.name)).items() if k in PER_NODE_VARS}
        for n in config.nodes
    ]
    return any(env != envs[0] for env in envs)


def engine_spec(
    config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None = None
) -> ContainerSpec:
    """The engine on the head, a Ray driver of the cluster (``fabric``: what every node has)."""
    fabric = fabric or {}
    head = config.head
    env = ray_env(head, config, fabric.get(head.name))
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
    env |= api_server_env(config)
    return group_spec(
        config,
        name=engine_container(config),
        role=ENGINE_ROLE,
        backend=BACKEND,
        argv=argv,
        env=env,
        fabric=fabric.get(head.name),
        volumes=[*model_mounts(config), f"{ray_volume(config)}:{RAY_TMP}"],
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


RayMember = GroupMember  # Ray's member list is the group's


def parse_members(stdout: str) -> list[RayMember]:
    line = stdout.strip().splitlines()[-1] if stdout.strip() else "[]"
    return [RayMember(m["ip"], bool(m["alive"]), float(m["gpus"])) for m in json.loads(line)]


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


class RayBackend(Backend):
    """Ray's: a Ray cluster of the nodes (`ray start`), then one `vllm serve` on the head whose
    workers Ray places. It asks the image whether Ray runs there."""

    name = BACKEND
    words = ""
    condition = "the image carries Ray"
    absent = "the image carries no Ray"

    def plan(
        self, config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None, reason: str
    ) -> LaunchPlan:
        return plan(config, fabric, reason)

    def question(self, config: ClusterConfig) -> ContainerSpec | None:
        return ray_check_spec(config)

    def answer(self, exit_code: int, output: str) -> str | None:
        lines = output.strip().splitlines()
        return lines[0] if exit_code == 0 and lines else None

    def found(self, answer: str | None) -> str | None:
        return f"the image carries Ray at {answer}" if answer else None

    def refusal(self, config: ClusterConfig, answer: str | None) -> str | None:
        if answer is not None:
            return None
        return (
            f'`ray` does not run in image {config.vllm.image} (backend = "ray"); vLLM images '
            'since 0.18 do not bundle Ray: set backend = "mp" (vLLM\'s own multi-node launcher, '
            "no Ray needed), or use an image that carries Ray (vLLM 0.17 or older, or one built "
            "FROM yours with `pip install ray[default]`)"
        )

    def look(
        self, docker: NodeDocker, config: ClusterConfig, running: Collection[str]
    ) -> GroupStatus:
        name = ray_container(config)
        if name not in running:
            return GroupStatus(self.name)  # no head to ask; the container check says so
        try:
            result = docker.exec_runner(name).run(
                ray_members_argv(config), timeout=MEMBERS_TIMEOUT_S, check=False
            )
        except RemoteError as exc:
            return GroupStatus(self.name, problems=[f"Ray membership unknown: {exc}"])
        if not result.ok:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            return GroupStatus(self.name, problems=[f"Ray membership unknown: {one_line(tail[0])}"])
        try:
            members = parse_members(result.stdout)
        except (ValueError, KeyError) as exc:
            return GroupStatus(self.name, problems=[f"Ray membership unreadable: {one_line(exc)}"])
        return GroupStatus(self.name, members, membership_problems(config, members))

    def settle(
        self,
        settle: Settle,
        config: ClusterConfig,
        docker_of: Callable[[str], NodeDocker],
        log: logging.Logger | logging.LoggerAdapter,
    ) -> GroupStatus:
        from vllm_redeploy.launch.ray_settle import wait_members  # it builds on this module

        if settle != "ray-members":
            raise ValueError(f"the Ray backend has no phase that settles by {settle!r}")
        members = wait_members(config, docker_of, log)
        return GroupStatus(self.name, members)

    def diagnostics(self, docker: NodeDocker, config: ClusterConfig) -> str:
        name = ray_container(config)
        if not docker.get(name):
            return ""
        status = docker.exec_runner(name).run(["ray", "status"], timeout=60, check=False)
        return "### ray status\n" + fenced((status.stdout or status.stderr).strip())


RAY = RayBackend()
