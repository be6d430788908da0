"""`run --dry-run`: per node, exactly what a run would stop, check and start. Read-only: the nodes
are asked what they have (containers, fabric, the head's image ENTRYPOINT: read from a container
created for it and removed unstarted), nothing of theirs is started or removed."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.config.launch import API_KEY_VARIABLE
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.launch import (
    ImageEntrypoint,
    LaunchPlan,
    NodeFabric,
    candidates,
    container_argv,
    plan_for,
)
from vllm_redeploy.launch.choose import AUTO, AUTO_NOTE
from vllm_redeploy.launch.loader import planned_words
from vllm_redeploy.masking import MASK
from vllm_redeploy.memory import DROP_SCRIPT
from vllm_redeploy.nodes import NodeAccess, RemoteError, fan_out, render_command
from vllm_redeploy.nodes.containers import ContainerInfo, ContainerSpec, cluster_labels
from vllm_redeploy.parsers.fabric import FABRIC_ARGV, FabricFacts, parse_fabric
from vllm_redeploy.parsers.nvidia_smi import COMPUTE_APPS_ARGV, GPUS_ARGV
from vllm_redeploy.safe_text import one_line, shown

# What a phase waits for once its containers are started, in words.
SETTLED = {
    "ray-members": "Ray sees every node at its fabric IP, with its GPUs",
}


@dataclass(frozen=True)
class _Seen:
    """What a node has now: the containers a run would remove, and its fabric."""

    old: list[str]
    ours: list[str]
    fabric: FabricFacts
    entrypoint: ImageEntrypoint | None = None  # the image's, on the head when it has it


def _look(config: ClusterConfig, node: NodeConfig) -> _Seen:
    with NodeAccess(node, config) as access:
        old, ours = access.docker.list_matching_and_labelled(
            config.autostart.containers, cluster_labels(config.name)
        )
        found = access.runner.run(list(FABRIC_ARGV), check=False)
        entrypoint = None
        if node is config.head and access.docker.image_id(config.vllm.image) is not None:
            entrypoint = ImageEntrypoint.of(*access.docker.image_entrypoint(config.vllm.image))
    return _Seen(
        [_named(c) for c in old],
        [_named(c) for c in ours],
        parse_fabric(found.stdout, node.ip),
        entrypoint,
    )


def _named(container: ContainerInfo) -> str:
    return f"{shown(container.name)} ({shown(container.status)})"


def plan_lines(config: ClusterConfig, inspect_nodes: bool = True) -> list[str]:
    seen = {}
    if inspect_nodes:
        seen = {o.node: o for o in fan_out(config.nodes, lambda n: _look(config, n))}
    fabric = {
        name: NodeFabric.of(o.value.fabric, _node(config, name), config)
        for name, o in seen.items()
        if o.value is not None
    }
    lines = [f"cluster {config.name}: dry run, nothing is changed"]
    for node in config.nodes:
        lines += _node_lines(config, node, seen.get(node.name), fabric.get(node.name))
    if config.vllm.backend == AUTO:
        lines.append(f"\n{AUTO_NOTE}")
    lines.append(f"\nweights loader: {planned_words(config)}")
    head = seen.get(config.head.name)
    entrypoint = head.value.entrypoint if head is not None and head.value is not None else None
    for backend, why in candidates(config):
        lines += launch_lines(config, plan_for(backend, config, fabric, why, entrypoint))
    lines.append(
        f"\nwait up to {config.deadlines.model_load_s:g} s until {api_base(config)}/v1/models "
        f"lists {config.vllm.served_name}; then prove NCCL's transport between the nodes"
    )
    lines.append(
        f"probe: {config.probe.prompt!r}, max_tokens {config.probe.max_tokens}, "
        f"temperature {config.probe.temperature:g}"
    )
    if config.secrets.vllm_api_key is not None:
        lines.append(
            f"API key: [secrets] vllm_api_key, given to the engine as {API_KEY_VARIABLE}={MASK}; "
            f"every request to /v1 sends Authorization: Bearer {MASK}"
        )
    return lines


def _node(config: ClusterConfig, name: str) -> NodeConfig:
    return next(n for n in config.nodes if n.name == name)


def _node_lines(
    config: ClusterConfig, node: NodeConfig, seen: object, fabric: NodeFabric | None
) -> list[str]:
    role = "head" if node is config.head else "worker"
    lines = [f"\n[{node.name}] {role}, {node.transport} {node.address}, fabric IP {node.ip}"]
    for unit in config.autostart.units:
        verb = "stop and disable" if config.autostart.disable_units else "stop"
        lines.append(f"  {verb} unit {unit} (if active)")
    error = getattr(seen, "error", None)
    value = getattr(seen, "value", None)
    if isinstance(error, RemoteError):
        lines.append(f"  cannot inspect the node now: {one_line(error)}")
    elif isinstance(value, _Seen):
        lines.append(f"  remove autostart containers: {', '.join(value.old) or 'none found'}")
        lines.append(f"  remove our earlier containers: {', '.join(value.ours) or 'none found'}")
        lines.append(f"  fabric: {_fabric(value.fabric, fabric)}")
    else:
        patterns = ", ".join(config.autostart.containers) or "none configured"
        lines.append(f"  remove containers matching: {patterns}; and ours (by label)")
    lines.append(f"  check GPUs: {render_command(COMPUTE_APPS_ARGV)}; {render_command(GPUS_ARGV)}")
    drop = config.memory.drop_page_cache
    when = "on unified memory (GB10)" if drop is None else ("yes" if drop else "no")
    lines.append(f"  drop the page cache first: {when} (a one-shot container: {DROP_SCRIPT})")
    return lines


def _fabric(facts: FabricFacts, fabric: NodeFabric | None) -> str:
    where = f"{facts.interface or 'no interface'} (MTU {facts.mtu or '?'})"
    if facts.twins:
        where += f", twins {', '.join(facts.twins)}"
    hcas = ", ".join(f"{h.name}:{h.port} {h.state}" for h in facts.hcas) or "no RDMA HCA"
    rdma = "yes" if fabric is not None and fabric.rdma else "no"
    problems = "; ".join(facts.problems())
    return f"{where}; {hcas}; RDMA into the containers: {rdma}" + (
        f"; {problems}" if problems else ""
    )


def launch_lines(config: ClusterConfig, plan: LaunchPlan) -> list[str]:
    secrets = config.secret_values()
    lines = [f"\n[launch] backend {plan.reason}"]
    for index, phase in enumerate(plan.phases):
        settles = "" if phase.settle == "started" else f", then wait: {SETTLED[phase.settle]}"
        lines.append(f"  step {phase.step}{settles}")
        for member in plan.phase(index):
            spec = member.spec
            api = ", serves the API" if member.serves_api else ""
            lines.append(f"  {member.role} on {member.node}{api}:")
            lines.append(
                f"  start container {spec.name} ({spec.image}): "
                f"{render_command(container_argv(spec), secrets)}"
            )
            lines += _options(spec, secrets, plan.entrypoint)
    ports = ", ".join(f"{words} {port}" for port, words in plan.ports)
    lines.append(f"  the head's ports must be free first: {ports}")
    return lines


def _options(
    spec: ContainerSpec, secrets: tuple[str, ...], image: ImageEntrypoint | None
) -> list[str]:
    if spec.entrypoint is None and image is not None and image.argv is not None:
        entrypoint = f"{render_command(list(image.argv))} ({image.why()})"
    else:
        why = image.why() if image is not None else "the image's own ENTRYPOINT does not run"
        entrypoint = f"{render_command(list(spec.entrypoint or ()))} (set explicitly: {why})"
    lines = [f"    entrypoint: {entrypoint}"]
    ulimits = ", ".join(f"{k}={v}" for k, v in spec.ulimits.items()) or "Docker's"
    lines.append(
        f"    devices: {', '.join(spec.devices) or 'none'}; capabilities: "
        f"{', '.join(spec.cap_add) or 'none added'}; ulimits: {ulimits}; privileged: "
        f"{'yes' if spec.privileged else 'no'}"
    )
    env = ", ".join(
        f"{k}={MASK if v in secrets else shown(v)}" for k, v in sorted(spec.env.items())
    )
    lines.append(f"    env: {env}")
    return lines
