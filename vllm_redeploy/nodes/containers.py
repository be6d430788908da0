"""What a container is to us, apart from how Docker is reached: the spec of one we start, what
Docker says of one that exists, and the labels by which we know our own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from vllm_redeploy import PROJECT

LABEL_MANAGED = "io.vllm-redeploy.managed-by"
LABEL_CLUSTER = "io.vllm-redeploy.cluster"
LABEL_ROLE = "io.vllm-redeploy.role"


def cluster_labels(cluster: str) -> dict[str, str]:
    """The labels that select every container this project made for ``cluster``."""
    return {LABEL_MANAGED: PROJECT, LABEL_CLUSTER: cluster}


def project_labels(cluster: str, role: str) -> dict[str, str]:
    """Labels on every container this project creates, so it can find its own."""
    return {**cluster_labels(cluster), LABEL_ROLE: role}


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    name: str
    image: str
    status: str  # created, running, paused, restarting, removing, exited, dead
    restart_policy: str
    labels: Mapping[str, str]
    exit_code: int | None
    oom_killed: bool
    started_at: datetime | None = None  # None when not running

    @property
    def running(self) -> bool:
        return self.status in ("running", "restarting")


@dataclass(frozen=True)
class ContainerSpec:
    """A detached container on the host's network and IPC namespace (as vLLM and Ray need)."""

    name: str
    image: str
    command: Sequence[str] = ()
    entrypoint: Sequence[str] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    volumes: Sequence[str] = ()  # docker -v syntax: HOST:CONTAINER[:ro]
    labels: Mapping[str, str] = field(default_factory=dict)
    shm_size: str | None = None
    gpus: int | None = None  # None: no GPU request; -1: all GPUs of the node
    pid_mode: str | None = None  # e.g. "container:NAME" to share another container's PIDs
    devices: Sequence[str] = ()  # docker --device syntax: HOST[:CONTAINER[:PERMISSIONS]]
    cap_add: Sequence[str] = ()
    ulimits: Mapping[str, int] = field(default_factory=dict)  # name -> soft = hard; -1 unlimited
    privileged: bool = False
    user: str | None = None  # None: the image's USER
