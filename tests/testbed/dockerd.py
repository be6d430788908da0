"""A real Docker engine with its own socket, data root and exec root; no bridge, no iptables."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import docker

from tests.testbed.image import busybox_rootfs
from tests.testbed.procs import kill_tree, pids_with_arg, spawn, wait_until

DOCKERD = "dockerd"
API_VERSION = "1.41"


@dataclass
class DockerEngine:
    root: Path  # keep short: containerd's socket path under it must fit in 108 bytes
    pid: int = 0
    enter: list[str] = field(default_factory=list)  # a prefix that runs it elsewhere (nsenter)

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> DockerEngine:
        self.root.mkdir(parents=True, exist_ok=True)
        # The exec root and pid file live on tmpfs (/run) on a real machine: a power cut wipes
        # them. Left behind, their stale PIDs would make the engine wait for a dead containerd.
        (self.root / "docker.pid").unlink(missing_ok=True)
        _unmount_below(self.root / "exec")
        shutil.rmtree(self.root / "exec", ignore_errors=True)
        proc = spawn(
            [
                *self.enter,
                DOCKERD,
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
                f"--data-root={self.root / 'data'}",
                f"--exec-root={self.root / 'exec'}",
                f"--pidfile={self.root / 'docker.pid'}",
                f"--host={self.url}",
                # Containers get 2 s to stop when the engine goes down (a node "reboot").
                "--shutdown-timeout=2",
            ],
            self.root / "dockerd.log",
        )
        self.pid = proc.pid
        wait_until(self._answers, 60, f"dockerd at {self.socket}", self.root / "dockerd.log")
        return self

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        with (
            contextlib.closing(self.client()) as client,
            contextlib.suppress(docker.errors.DockerException),
        ):
            return bool(client.ping())
        return False

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.url, version=API_VERSION, timeout=30)

    def import_rootfs(self, data: bytes, tag: str, changes: list[str] | None = None) -> str:
        """`docker import` of a root filesystem tarball; returns the image ID."""
        repository, _, version = tag.partition(":")
        with contextlib.closing(self.client()) as client:
            client.api.import_image_from_data(
                data, repository=repository, tag=version or "latest", changes=changes
            )
            return client.images.get(tag).id

    def import_busybox(self, tag: str) -> str:
        """A registry-free image: a root filesystem of static busybox."""
        return self.import_rootfs(busybox_rootfs(), tag)

    def save(self, tag: str) -> bytes:
        with contextlib.closing(self.client()) as client:
            return b"".join(client.images.get(tag).save(named=True))

    def load(self, data: bytes) -> None:
        with contextlib.closing(self.client()) as client:
            client.images.load(data)

    def stop_engine(self, graceful: bool = False) -> None:
        """Stop the engine. By default as at a power cut: the engine, containerd and every
        container die at once (SIGKILL); at the next start the engine applies restart policies."""
        if self.pid:
            kill_tree(self.pid, grace=15 if graceful else 0)
            self.pid = 0
        # containerd's shims re-parent themselves away from the engine: find them by our exec
        # root on their command line; killing one kills its container.
        for shim in pids_with_arg(str(self.root / "exec")):
            kill_tree(shim, grace=0)

    def remove_data(self) -> None:
        _unmount_below(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    def stop(self) -> None:
        """Remove every container, stop the engine and delete its data."""
        if self.pid:
            with contextlib.closing(self.client()) as client, contextlib.suppress(Exception):
                for container in client.containers.list(all=True):
                    container.remove(force=True)
        self.stop_engine()
        self.remove_data()


def _unmount_below(directory: Path) -> None:
    """Lazily unmount what a killed engine left mounted (overlays, netns), deepest first."""
    for line in reversed(Path("/proc/mounts").read_text().splitlines()):
        point = line.split()[1]
        if point.startswith(f"{directory}/"):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
