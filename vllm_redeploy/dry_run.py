"""`run --dry-run`: per node, exactly what a run would stop, start and check. Read-only."""

from __future__ import annotations

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.nodes import NodeAccess, RemoteError, fan_out, render_command
from vllm_redeploy.nodes.docker import ContainerInfo, cluster_labels
from vllm_redeploy.parsers.nvidia_smi import COMPUTE_APPS_ARGV, GPUS_ARGV
from vllm_redeploy.plan import engine_spec, ray_spec
from vllm_redeploy.safe_text import one_line, shown


def _found(config: ClusterConfig, name: str) -> tuple[list[str], list[str]]:
    """The containers a run would remove on the node: (autostart matches, our own)."""
    node = next(n for n in config.nodes if n.name == name)
    with NodeAccess(node, config) as access:
        old = access.docker.list_containers(config.autostart.containers)
        ours = access.docker.list_containers(labels=cluster_labels(config.name))
    return [_named(c) for c in old], [_named(c) for c in ours]


def _named(container: ContainerInfo) -> str:
    return f"{shown(container.name)} ({shown(container.status)})"


def plan_lines(config: ClusterConfig, inspect_nodes: bool = True) -> list[str]:
    secrets = config.secret_values()
    found = {}
    if inspect_nodes:
        found = {o.node: o for o in fan_out(config.nodes, lambda n: _found(config, n.name))}
    lines = [f"cluster {config.name}: dry run, nothing is changed"]
    for node in config.nodes:
        role = "head" if node is config.head else "worker"
        lines.append(
            f"\n[{node.name}] {role}, {node.transport} {node.address}, fabric IP {node.ip}"
        )
        for unit in config.autostart.units:
            verb = "stop and disable" if config.autostart.disable_units else "stop"
            lines.append(f"  {verb} unit {unit} (if active)")
        outcome = found.get(node.name)
        if outcome is not None and isinstance(outcome.error, RemoteError):
            lines.append(f"  cannot inspect containers now: {one_line(outcome.error)}")
        elif outcome is not None and outcome.value is not None:
            old, ours = outcome.value
            lines.append(f"  remove autostart containers: {', '.join(old) or 'none found'}")
            lines.append(f"  remove our earlier containers: {', '.join(ours) or 'none found'}")
        else:
            patterns = ", ".join(config.autostart.containers) or "none configured"
            lines.append(f"  remove containers matching: {patterns}; and ours (by label)")
        lines.append(
            f"  check GPUs: {render_command(COMPUTE_APPS_ARGV)}; {render_command(GPUS_ARGV)}"
        )
        spec = ray_spec(node, config)
        lines.append(
            f"  start container {spec.name} ({spec.image}): "
            f"{render_command(list(spec.command), secrets)}"
        )
        env = ", ".join(f"{k}={v}" for k, v in sorted(spec.env.items()) if v not in secrets)
        lines.append(f"    env: {env}")
    engine = engine_spec(config)
    lines.append(f"\n[{config.head.name}] engine")
    lines.append(
        f"  start container {engine.name}: {render_command(list(engine.command), secrets)}"
    )
    lines.append(
        f"  wait up to {config.deadlines.model_load_s:g} s until "
        f"{api_base(config)}/v1/models lists "
        f"{config.vllm.served_name}"
    )
    lines.append(
        f"  probe: {config.probe.prompt!r}, max_tokens {config.probe.max_tokens}, "
        f"temperature {config.probe.temperature:g}"
    )
    return lines
