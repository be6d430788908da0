"""How we reach a node: commands over SSH or locally, Docker through the SDK. No Prefect here."""

from vllm_redeploy.nodes.access import (
    NodeAccess,
    NodeOutcome,
    NodeReport,
    check_node,
    check_nodes,
    fan_out,
    runner_for,
)
from vllm_redeploy.nodes.containers import ContainerInfo, ContainerSpec, project_labels
from vllm_redeploy.nodes.docker import DockerError, NodeDocker
from vllm_redeploy.nodes.errors import (
    AuthenticationFailed,
    CommandError,
    CommandFailed,
    CommandTimedOut,
    ConnectionLost,
    HostKeyRejected,
    NodeUnreachable,
    RemoteError,
)
from vllm_redeploy.nodes.library_logs import route_library_logs
from vllm_redeploy.nodes.local import LocalRunner
from vllm_redeploy.nodes.result import CommandResult, render_command
from vllm_redeploy.nodes.runner import Runner
from vllm_redeploy.nodes.ssh import SSHRunner, SSHTarget

# Whoever reaches nodes through this package gets the libraries' noise at debug level only.
route_library_logs()

__all__ = [
    "AuthenticationFailed",
    "CommandError",
    "CommandFailed",
    "CommandResult",
    "CommandTimedOut",
    "ConnectionLost",
    "ContainerInfo",
    "ContainerSpec",
    "DockerError",
    "HostKeyRejected",
    "LocalRunner",
    "NodeAccess",
    "NodeDocker",
    "NodeOutcome",
    "NodeReport",
    "NodeUnreachable",
    "RemoteError",
    "Runner",
    "SSHRunner",
    "SSHTarget",
    "check_node",
    "check_nodes",
    "fan_out",
    "project_labels",
    "render_command",
    "runner_for",
]
