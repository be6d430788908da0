"""The nodes and how the controller reaches them: ``[[nodes]]`` and ``[ssh]``."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, IPvAnyAddress, SecretStr, model_validator

from vllm_redeploy.config.fields import (
    HOST_PATTERN,
    Interface,
    Name,
    Port,
    Seconds,
    Section,
    matches,
)


class NodeConfig(Section):
    name: Name = Field(description="Short name used in messages and task names, e.g. spark-a.")
    address: Annotated[str, matches(HOST_PATTERN, "host name or IP address")] = Field(
        description="Where the controller reaches the node (SSH host name or IP)."
    )
    transport: Literal["ssh", "local"] = Field(
        "ssh", description='"ssh", or "local" when the controller is this node (no SSH).'
    )
    ssh_user: Name | None = Field(
        None, description="SSH user; default: ssh.user, then the current user."
    )
    ssh_port: Port = Field(22, description="SSH port.")
    ssh_key_file: Path | None = Field(
        None, description="Private key; default: ssh.key_file, then the SSH agent and ~/.ssh keys."
    )
    fabric_ip: IPvAnyAddress | None = Field(
        None,
        description="IP on the fast fabric that vLLM, NCCL and Ray must use (VLLM_HOST_IP; "
        "ray --node-ip-address). Default: address, when address is an IP.",
    )
    fabric_interfaces: list[Interface] = Field(
        default_factory=list,
        description="Fabric interface names for NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, "
        "TP_SOCKET_IFNAME and UCX_NET_DEVICES (a Spark has them in pairs). Every node must name "
        "as many (Gloo's rule); default: the one the fabric IP is on (and its twins for NCCL).",
    )
    ib_hcas: list[Interface] = Field(
        default_factory=list, description="NCCL_IB_HCA devices, e.g. rocep1s0f0."
    )
    gpus: int = Field(1, ge=1, le=64, description="GPUs this node gives to the cluster.")
    head: bool = Field(
        False,
        description="The head node: the Ray head (ray backend) or the leader, rank 0, that serves "
        "the API (mp backend). Default: the first node.",
    )
    docker_host: str | None = Field(
        None,
        description="Local transport only: Docker socket URL; "
        "default: DOCKER_HOST or the system socket.",
    )

    @model_validator(mode="after")
    def _fabric_ip_from_address(self) -> Self:
        if self.fabric_ip is None:
            try:
                self.fabric_ip = ipaddress.ip_address(self.address)
            except ValueError:
                raise ValueError(
                    f"fabric_ip is required because address {self.address!r} is a host name: "
                    "set it to the node's IP on the fabric "
                    "(what `ray start --node-ip-address` gets)"
                ) from None
        if self.docker_host and self.transport != "local":
            raise ValueError(
                'docker_host applies to transport = "local" only; remove it for SSH nodes'
            )
        return self

    @property
    def ip(self) -> str:
        return str(self.fabric_ip)


class SSHConfig(Section):
    user: Name | None = Field(None, description="Default SSH user for all nodes.")
    key_file: Path | None = Field(None, description="Default private key for all nodes.")
    key_passphrase: SecretStr | None = Field(
        None, description="Passphrase of the key file, if any."
    )
    known_hosts: Path = Field(
        Path("~/.ssh/known_hosts"),
        description="known_hosts file the node host keys are checked against.",
    )
    trust_on_first_use: bool = Field(
        False,
        description="Record an unknown host key on first connection "
        "(a changed key is always refused).",
    )
    connect_timeout_s: Seconds = Field(
        10, description="TCP connect, handshake and authentication timeout."
    )
    command_timeout_s: Seconds = Field(
        60, description="Wall-clock timeout of one quick remote command (inspections, checks)."
    )
    keepalive_s: int = Field(
        5, ge=1, description="SSH keepalive interval; a dead link is noticed in about 3x this."
    )
