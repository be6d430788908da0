"""One handle per configured node: its command runner and its Docker, opened lazily."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.nodes.docker import NodeDocker, node_docker_for
from vllm_redeploy.nodes.errors import RemoteError
from vllm_redeploy.nodes.local import LocalRunner
from vllm_redeploy.nodes.privilege import RootAccess, probe_root
from vllm_redeploy.nodes.runner import Runner
from vllm_redeploy.nodes.ssh import SSHRunner, SSHTarget
from vllm_redeploy.parsers.fabric import FABRIC_ARGV, FabricFacts, parse_fabric

T = TypeVar("T")


def runner_for(node: NodeConfig, config: ClusterConfig) -> Runner:
    """The command runner for ``node`` as configured (SSH or local)."""
    secrets = config.secret_values()
    if node.transport == "local":
        return LocalRunner(node.name, secrets, config.ssh.command_timeout_s)
    ssh = config.ssh
    key_file = node.ssh_key_file or ssh.key_file
    passphrase = ssh.key_passphrase.get_secret_value() if ssh.key_passphrase else None
    target = SSHTarget(
        host=node.address,
        port=node.ssh_port,
        user=node.ssh_user or ssh.user,
        key_file=key_file,
        key_passphrase=passphrase,
        known_hosts=ssh.known_hosts,
        trust_on_first_use=ssh.trust_on_first_use,
        connect_timeout_s=ssh.connect_timeout_s,
        keepalive_s=ssh.keepalive_s,
    )
    return SSHRunner(node.name, target, secrets, config.ssh.command_timeout_s)


class NodeAccess:
    """Commands and Docker on one node, sharing one connection. Close it when done."""

    def __init__(self, node: NodeConfig, config: ClusterConfig) -> None:
        self.config = node
        self.name = node.name
        self.runner = runner_for(node, config)
        self._docker: NodeDocker | None = None
        self._root: RootAccess | None = None

    def __repr__(self) -> str:
        return f"<NodeAccess {self.runner!r}>"

    @property
    def docker(self) -> NodeDocker:
        if self._docker is None:
            self._docker = node_docker_for(self.runner, self.config.docker_host)
        return self._docker

    def root(self) -> RootAccess:
        """Who the login is and how it runs a command as root (asked once)."""
        if self._root is None:
            self._root = probe_root(self.runner)
        return self._root

    def close(self) -> None:
        if self._docker is not None:
            self._docker.close()
            self._docker = None
        self.runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class NodeOutcome(Generic[T]):
    """What one node gave for a fan-out: a value, or the error it raised."""

    node: str
    value: T | None = None
    error: RemoteError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def fan_out(nodes: Iterable[NodeConfig], fn: Callable[[NodeConfig], T]) -> list[NodeOutcome[T]]:
    """Call ``fn`` for every node in parallel; per-node values or RemoteErrors, in node order."""
    nodes = list(nodes)

    def one(node: NodeConfig) -> NodeOutcome[T]:
        try:
            return NodeOutcome(node.name, value=fn(node))
        except RemoteError as exc:
            return NodeOutcome(node.name, error=exc)

    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") as pool:
        return list(pool.map(one, nodes))


@dataclass(frozen=True)
class NodeReport:
    """What `vllm-redeploy nodes` shows for one node."""

    name: str
    address: str
    transport: str
    reachable: bool
    rtt_ms: float | None = None
    docker_version: str | None = None
    error: str | None = None
    fabric: dict[str, Any] | None = None  # what the fabric discovery found (fabric_summary)


def check_node(node: NodeConfig, config: ClusterConfig) -> NodeReport:
    """Reach the node, time a round trip, ask its Docker engine for its version, and discover its
    fabric (the interface owning the fabric IP, its RDMA HCAs, MTU)."""
    with NodeAccess(node, config) as access:
        try:
            rtt = access.runner.round_trip_s(timeout=config.ssh.connect_timeout_s)
        except RemoteError as exc:
            return NodeReport(node.name, node.address, node.transport, False, error=str(exc))
        try:
            found = access.runner.run(list(FABRIC_ARGV), check=False)
            fabric = fabric_summary(parse_fabric(found.stdout, node.ip))
        except RemoteError:
            fabric = None
        try:
            version = access.docker.version()
        except RemoteError as exc:
            return NodeReport(
                node.name, node.address, node.transport, True, rtt * 1000, error=str(exc),
                fabric=fabric,
            )  # fmt: skip
    return NodeReport(
        node.name, node.address, node.transport, True, rtt * 1000, version, fabric=fabric
    )


def check_nodes(config: ClusterConfig) -> list[NodeReport]:
    """``check_node`` for every node, in parallel; a node it could not start on reported as
    unreachable with its error."""
    outcomes = fan_out(config.nodes, lambda n: check_node(n, config))
    return [
        o.value
        if o.value is not None
        else NodeReport(node.name, node.address, node.transport, False, error=str(o.error))
        for node, o in zip(config.nodes, outcomes, strict=True)
    ]


def fabric_summary(facts: FabricFacts) -> dict[str, Any]:
    """A node's fabric as people and scripts read it."""
    return {
        "interface": facts.interface,
        "mtu": facts.mtu,
        "twins": list(facts.twins),
        "hcas": [
            {"name": h.name, "port": h.port, "state": h.state, "netdev": h.netdev}
            for h in facts.hcas
        ],
        "nccl_ib_hca": facts.nccl_ib_hca,
        "rdma_devices": list(facts.rdma_devices),
        "problems": list(facts.problems()),
    }
