"""A real Docker engine with its own socket, data root and exec root; no bridge, no iptables."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import docker

from tests.testbed.procs import spawn, stop, wait_until

DOCKERD = "dockerd"
BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = ("sh", "sleep", "cat", "echo", "true", "false", "env", "ls", "timeout", "kill")


@dataclass
class DockerEngine:
    root: Path  # keep short: containerd's socket path under it must fit in 108 bytes
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> DockerEngine:
        self.root.mkdir(parents=True, exist_ok=True)
        self._proc = spawn(
            [
                DOCKERD,
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
                f"--data-root={self.root / 'data'}",
                f"--exec-root={self.root / 'exec'}",
                f"--pidfile={self.root / 'docker.pid'}",
                f"--host={self.url}",
            ],
            self.root / "dockerd.log",
        )
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
        return docker.DockerClient(base_url=self.url, version="1.41", timeout=30)

    def import_busybox(self, tag: str) -> str:
        """A registry-free image: a root filesystem of static busybox, made with `docker import`."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(BUSYBOX, arcname="bin/busybox")
            for applet in BUSYBOX_APPLETS:
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type = tarfile.SYMTYPE
                link.linkname = "busybox"
                tar.addfile(link)
            for directory in ("tmp", "proc", "sys", "dev", "etc"):
                info = tarfile.TarInfo(directory)
                info.type = tarfile.DIRTYPE
                info.mode = 0o1777 if directory == "tmp" else 0o755
                tar.addfile(info)
        repository, _, version = tag.partition(":")
        with contextlib.closing(self.client()) as client:
            response = client.api.import_image_from_data(
                buf.getvalue(), repository=repository, tag=version or "latest"
            )
            del response
            return client.images.get(tag).id

    def stop(self) -> None:
        if self._proc is not None:
            with contextlib.closing(self.client()) as client:
                for container in client.containers.list(all=True):
                    container.remove(force=True)
            stop(self._proc, grace=20)
            self._proc = None
        shutil.rmtree(self.root, ignore_errors=True)
