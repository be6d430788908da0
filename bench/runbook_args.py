"""Print, as bash variables, what bench/reference_runbook.sh needs from a cluster.toml.

    .venv/bin/python -m bench.runbook_args cluster.toml

The containers are the flow's own (the Ray backend's plan, from the launch registry: same image,
command, environment, mounts, names and labels), written as `docker run` command lines, so the
reference script launches exactly what the flow launches and the two can be timed on the same
bed.
"""

from __future__ import annotations

import shlex
import sys

from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.launch import LaunchPlan, plan_for
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec


def docker_run(spec: ContainerSpec) -> str:
    """``spec`` as the `docker run` line the flow's Docker SDK call amounts to."""
    if spec.entrypoint is not None and len(spec.entrypoint) != 1:
        raise ValueError(f"{spec.name}: an entrypoint list has no docker CLI equivalent here")
    argv = ["docker", "run", "-d", "--name", spec.name, "--network", "host", "--ipc", "host"]
    if spec.entrypoint:
        argv += ["--entrypoint", spec.entrypoint[0]]
    argv += ["--restart", "no"]
    if spec.pid_mode:
        argv += ["--pid", spec.pid_mode]
    if spec.shm_size:
        argv += ["--shm-size", spec.shm_size]
    if spec.gpus is not None:
        argv += ["--gpus", "all" if spec.gpus < 0 else str(spec.gpus)]
    for device in spec.devices:
        argv += ["--device", device]
    for capability in spec.cap_add:
        argv += ["--cap-add", capability]
    for name, value in spec.ulimits.items():
        argv += ["--ulimit", f"{name}={value}:{value}"]
    if spec.privileged:
        argv.append("--privileged")
    for key, value in spec.env.items():
        argv += ["-e", f"{key}={value}"]
    for volume in spec.volumes:
        argv += ["-v", volume]
    for key, value in spec.labels.items():
        argv += ["--label", f"{key}={value}"]
    return shlex.join([*argv, spec.image, *spec.command])


BACKEND = "ray"  # what the reference runbook launches by hand: Ray, then `vllm serve`


def stale_regex(config: ClusterConfig, plan: LaunchPlan) -> str:
    """One extended regex for the autostart containers' globs and our own earlier containers:
    the plan's, and any other of the cluster's (an earlier mp group's follower holds its GPU)."""
    ours = sorted({m.spec.name for m in plan.members})
    globs = [*config.autostart.containers, *ours, container_name(config.name, "*")]
    return "^(" + "|".join(glob_to_ere(g) for g in globs) + ")$"


def glob_to_ere(glob: str) -> str:
    """A container-name glob (letters, digits, ``_.-``, ``*?[]``) as a POSIX extended regex."""
    return glob.replace(".", "\\.").replace("*", ".*").replace("?", ".").replace("[!", "[^")


def variables(config: ClusterConfig) -> dict[str, str | list[str]]:
    ssh = config.ssh
    nodes = config.nodes
    head = nodes.index(config.head)
    plan = plan_for(BACKEND, config)
    ray = {m.node: m.spec for m in plan.members if m is not plan.api}  # one per node
    return {
        "SSH_KEY": str(ssh.key_file.expanduser()) if ssh.key_file else "",
        "KNOWN_HOSTS": str(ssh.known_hosts.expanduser()),
        "NODES": [f"{n.ssh_user or ssh.user or 'root'}@{n.address}" for n in nodes],
        "PORTS": [str(n.ssh_port) for n in nodes],
        "HEAD": str(head),
        "UNITS": " ".join(config.autostart.units),
        "STALE": stale_regex(config, plan),
        "RAY_RUN": [docker_run(ray[n.name]) for n in nodes],
        "RAY_CONTAINER": ray[config.head.name].name,
        "RAY_ADDRESS": f"{config.head.ip}:{config.ray.port}",
        "GPUS": str(sum(n.gpus for n in nodes)),
        "ENGINE_RUN": docker_run(plan.api.spec),
        "API": api_base(config),
        "MODEL": config.vllm.served_name,
    }


def as_bash(values: dict[str, str | list[str]]) -> str:
    lines = []
    for name, value in values.items():
        if isinstance(value, list):
            lines.append(f"{name}=({' '.join(shlex.quote(v) for v in value)})")
        else:
            lines.append(f"{name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m bench.runbook_args CLUSTER_TOML")
    sys.stdout.write(as_bash(variables(load_config(sys.argv[1], env_file=None))))


if __name__ == "__main__":
    main()
