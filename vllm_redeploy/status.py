"""The deployment as it is now, and the one judgement of its health. No Prefect here (fast).

Every node is contacted in parallel (reachable, SSH round trip, our containers by label, who holds
the GPU; on the head also what the running group's backend says of it: Ray's members), while the
endpoint is asked for its models, health and version and given a fresh probe. ``judge`` turns
that into problems; no problem is healthy. `vllm-redeploy status` shows it, `ensure` redeploys
unless it is healthy: both read ``collect_status``, so they agree on every fault.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from vllm_redeploy.answers import fetch
from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.endpoint import api_base, api_key, auth_headers, engine_version, list_models
from vllm_redeploy.generation import GenerationCheck, check_generation
from vllm_redeploy.gpus import inspect_gpus
from vllm_redeploy.launch import (
    ENGINE_ROLE,
    LABEL_BACKEND,
    LABEL_LAUNCH,
    LABEL_LOADER,
    LaunchPlan,
    assumed,
    engine_container,
    plan_for,
)
from vllm_redeploy.launch.backend import GroupStatus
from vllm_redeploy.launch.choose import BACKENDS
from vllm_redeploy.launch.fingerprint import launch_changed
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes import NodeAccess, RemoteError, fan_out
from vllm_redeploy.nodes.containers import LABEL_ROLE, cluster_labels
from vllm_redeploy.probe import ProbeVerdict, run_probe
from vllm_redeploy.safe_text import shown
from vllm_redeploy.transport import TransportVerdict, judge_nodes

HTTP_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


@dataclass(frozen=True)
class ContainerStatus:
    name: str
    role: str
    status: str  # Docker's: running, exited, ...
    running: bool
    uptime_s: float | None = None
    exit_code: int | None = None
    launch: str | None = None  # the launch fingerprint it was started with
    backend: str | None = None  # ray or mp
    loader: str | None = None  # the weight loader it was started with, and why


@dataclass(frozen=True)
class GpuHolder:
    pid: int
    name: str
    memory_mib: int | None


@dataclass(frozen=True)
class GpuStatus:
    clear: bool
    holders: list[GpuHolder] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NodeStatus:
    name: str
    address: str
    ip: str  # the fabric IP, as Ray knows the node
    role: str  # head or worker
    reachable: bool
    rtt_ms: float | None = None
    error: str | None = None
    containers: list[ContainerStatus] = field(default_factory=list)
    gpu: GpuStatus | None = None


@dataclass(frozen=True)
class EndpointStatus:
    url: str
    served_name: str
    models: list[str] | None  # what /v1/models lists; None when it did not answer with a list
    models_error: str | None
    health: int | None  # /health status code; None when it did not answer
    version: str | None
    probe: ProbeVerdict | None  # None: not sent (the watcher's quick look, or the engine hangs)
    generation: GenerationCheck | None = None  # a 1-token generation: answered, busy or stuck


@dataclass(frozen=True)
class ClusterStatus:
    cluster: str
    nodes: list[NodeStatus]
    group: GroupStatus  # what the running group's backend says of it (Ray: its members)
    endpoint: EndpointStatus
    problems: list[str]
    transport: TransportVerdict | None = None  # what NCCL used, read from the ranks' logs

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def engine(self) -> ContainerStatus | None:
        """The container that serves the API (the engine, or the mp leader): the engine's name
        on every backend."""
        name = container_name(self.cluster, ENGINE_ROLE)
        return next((c for n in self.nodes for c in n.containers if c.name == name), None)

    @property
    def backend(self) -> str | None:
        return next((c.backend for n in self.nodes for c in n.containers if c.backend), None)

    @property
    def loader(self) -> str | None:
        """The loader the engine was started with (the run's choice, as labelled)."""
        return self.engine.loader if self.engine else None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["healthy"] = self.healthy
        data["endpoint"]["served"] = self.endpoint_serves
        data["endpoint"]["engine"] = asdict(self.engine) if self.engine else None
        data["backend"] = self.backend
        data["loader"] = self.loader
        data["transport"] = self.transport.as_dict() if self.transport else None
        return data

    @property
    def endpoint_serves(self) -> bool:
        return (
            self.endpoint.models is not None and self.endpoint.served_name in self.endpoint.models
        )


# --- collecting ------------------------------------------------------------------------------


def collect_status(
    config: ClusterConfig, quick: bool = False, generate: bool | None = None
) -> ClusterStatus:
    """Look at every node and the endpoint, in parallel; change nothing. ``quick`` (the
    watcher's look, every few seconds) leaves out what costs: the probe (a real completion),
    nvidia-smi, the backend's look at the group (Ray's member list) and the ranks' logs; what
    runs and what the API says stay.
    ``generate`` (default: unless quick) also sends a 1-token generation, which tells a hung
    engine (/health 200, no token) from a busy one."""
    generate = not quick if generate is None else generate
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint") as pool:
        endpoint = pool.submit(check_endpoint, config, not quick, generate)
        outcomes = fan_out(config.nodes, lambda n: _node_status(n, config, quick))
        group = GroupStatus()
        nodes = []
        logs: list[tuple[str, str]] = []
        for node, outcome in zip(config.nodes, outcomes, strict=True):
            if outcome.value is not None:
                status, seen, rank_logs = outcome.value
                nodes.append(status)
                logs += [(node.name, text) for text in rank_logs]
                if seen is not None:
                    group = seen
            else:
                nodes.append(_unreachable(node, config, str(outcome.error)))
        answered = endpoint.result()
        transport = None
        if logs and len(config.nodes) > 1:
            ips = {n.ip: n.name for n in config.nodes}
            transport = judge_nodes(logs, ips, [n.name for n in config.nodes])
        problems = judge(config, nodes, group, answered)
        return ClusterStatus(config.name, nodes, group, answered, problems, transport)


def _node_status(
    node: NodeConfig, config: ClusterConfig, quick: bool = False
) -> tuple[NodeStatus, GroupStatus | None, list[str]]:
    """The node as it is; on the head also the backend's look at the group; the logs of its
    running vLLM ranks."""
    role = "head" if node is config.head else "worker"
    with NodeAccess(node, config) as access:
        timeout = config.ssh.connect_timeout_s
        try:
            rtt = access.runner.round_trip_s(timeout=timeout)
        except RemoteError as exc:
            return _unreachable(node, config, str(exc)), None, []
        rtt_ms = round(rtt * 1000, 1)
        gpu = None if quick else _gpu(access)
        try:
            containers = _containers(access, node, config)
        except RemoteError as exc:  # reachable, but Docker did not answer
            status = NodeStatus(
                node.name, node.address, node.ip, role, True, rtt_ms, str(exc), [], gpu
            )
            return status, None, []  # the node's error says it; the group is not asked
        group = _group(access, config, containers) if role == "head" and not quick else None
        status = NodeStatus(
            node.name, node.address, node.ip, role, True, rtt_ms, None, containers, gpu
        )
        return status, group, [] if quick else _rank_logs(access, config, containers)


def _rank_logs(
    access: NodeAccess, config: ClusterConfig, containers: list[ContainerStatus]
) -> list[str]:
    """The start of the logs of the running containers whose ranks log NCCL's choice (the plan
    of what runs says which: with Ray the engine's holds every node's)."""
    rank_logs = {m.spec.name for m in running_plan(config, [containers]).rank_logs}
    logs = []
    for c in containers:
        if c.running and c.name in rank_logs:
            with contextlib.suppress(RemoteError):
                logs.append(access.docker.log_head(c.name))
    return logs


def _unreachable(node: NodeConfig, config: ClusterConfig, error: str) -> NodeStatus:
    role = "head" if node is config.head else "worker"
    return NodeStatus(node.name, node.address, node.ip, role, False, error=error)


def _containers(
    access: NodeAccess, node: NodeConfig, config: ClusterConfig
) -> list[ContainerStatus]:
    labels = cluster_labels(config.name)
    found = access.docker.list_containers(labels=labels)
    now = datetime.now(UTC)
    return [
        ContainerStatus(
            c.name,
            c.labels.get(LABEL_ROLE, "?"),
            c.status,
            c.running,
            max(0.0, round((now - c.started_at).total_seconds(), 1)) if c.started_at else None,
            c.exit_code,
            c.labels.get(LABEL_LAUNCH),
            c.labels.get(LABEL_BACKEND),
            c.labels.get(LABEL_LOADER) or None,
        )
        for c in sorted(found, key=lambda c: c.name)
    ]


def _gpu(access: NodeAccess) -> GpuStatus:
    try:
        report = inspect_gpus(access.name, access.runner)
    except RemoteError as exc:
        return GpuStatus(False, problems=[f"nvidia-smi could not be read: {exc}"])
    holders = [GpuHolder(p.pid, p.process_name, p.used_mib) for p in report.processes]
    return GpuStatus(report.clear, holders, list(report.problems))


def _group(
    access: NodeAccess, config: ClusterConfig, containers: list[ContainerStatus]
) -> GroupStatus:
    """What the backend of what runs on the head (by its label) says of the group."""
    backend = running_plan(config, [containers]).backend
    running = {c.name for c in containers if c.running}
    return BACKENDS[backend].look(access.docker, config, running)


def check_endpoint(
    config: ClusterConfig, probe: bool = True, generate: bool = False
) -> EndpointStatus:
    """What the API answers. The 1-token generation goes first."""
    base = api_base(config)
    want = config.vllm.served_name
    key = api_key(config)
    health: int | None = None
    with httpx.Client(timeout=HTTP_TIMEOUT, headers=auth_headers(key)) as client:
        models, models_error = list_models(client, base)
        if models is not None:  # else /health tells nothing more, and may cost its deadline
            with contextlib.suppress(httpx.HTTPError):
                health = fetch(client, "GET", f"{base}/health").status_code
        version = engine_version(client, base) if models is not None and probe else None
    generation = verdict = None
    if generate and models is not None:
        generation = check_generation(base, want, config.watch.generate_timeout_s, key)
    # Not sent when /v1/models does not answer (it would only wait out its own timeout), nor
    # when the engine hangs.
    if probe and models is not None and (generation is None or generation.verdict != "stuck"):
        p = config.probe
        verdict = run_probe(base, want, p.prompt, p.max_tokens, p.temperature, p.timeout_s, key)
    return EndpointStatus(
        f"{base}/v1", want, models, models_error, health, version, verdict, generation
    )


def judge(
    config: ClusterConfig, nodes: list[NodeStatus], group: GroupStatus, endpoint: EndpointStatus
) -> list[str]:
    """What keeps the deployment from being whole, healthy and as configured (empty: healthy)."""
    problems = []
    engine_name = engine_container(config)
    plan = running_plan(config, [n.containers for n in nodes])
    for node in nodes:
        if not node.reachable:
            problems.append(f"{node.name} is unreachable: {node.error}")
            continue
        if node.error:
            problems.append(node.error)
            continue
        running = {c.name for c in node.containers if c.running}
        for member in plan.on(node.name):
            if member.spec.name not in running:
                problems.append(f"{member.what} on {node.name} is not running")
        engine = next((c for c in node.containers if c.name == engine_name and c.running), None)
        if engine is not None and engine.launch != plan.fingerprint:
            why = launch_changed(config, plan, engine.launch)
            problems.append(f"the engine on {node.name} {why}")
    if plan.rendezvous_port is not None:
        problems += _orphans(config, plan, nodes)
    problems += group.problems
    if endpoint.models is None:
        problems.append(f"{endpoint.url}/models does not answer: {endpoint.models_error}")
    elif endpoint.served_name not in endpoint.models:
        listed = ", ".join(map(shown, endpoint.models)) or "nothing"
        problems.append(f"{endpoint.url}/models lists {listed}, not {endpoint.served_name}")
    if endpoint.health != 200 and endpoint.models is not None:
        problems.append(f"/health answered {endpoint.health or 'nothing'}")
    generation = endpoint.generation
    if generation is not None and generation.problem and endpoint.models is not None:
        problems.append(generation.problem)
    if endpoint.probe is not None and not endpoint.probe.healthy and endpoint.models is not None:
        problems.append(f"the probe failed: {endpoint.probe.detail}")
    return problems


def _orphans(config: ClusterConfig, plan: LaunchPlan, nodes: list[NodeStatus]) -> list[str]:
    """Members that run on without the member that serves the API, in a group that meets at a
    rendezvous: vLLM's mp followers do not exit when the leader dies (vllm#32136) and cannot
    join a new one, so left alone they hold their GPUs."""
    running = {(n.name, c.name) for n in nodes for c in n.containers if c.running}
    api = plan.api
    head_seen = any(n.name == api.node and n.reachable and not n.error for n in nodes)
    if not head_seen or (api.node, api.spec.name) in running:
        return []
    return [
        f"{m.what} on {m.node} still runs without {api.what}, and cannot join a new one; the "
        "next run (or ensure) replaces the whole group"
        for m in plan.members
        if (m.node, m.spec.name) in running
    ]


def running_plan(config: ClusterConfig, containers: list[list[ContainerStatus]]) -> LaunchPlan:
    """The plan of what runs, by its containers' backend label; with nothing of ours running,
    the configured backend's."""
    labels = (c.backend for found in containers for c in found)
    backend = next((b for b in labels if b in BACKENDS), assumed(config))
    return plan_for(backend, config)


def duration(seconds: float | None) -> str:
    """Uptime for people: 45 s, 12 min 3 s, 5 h 2 min, 3 d 4 h."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"
