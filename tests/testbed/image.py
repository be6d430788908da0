"""The test bed's image for Ray and vLLM containers, made without a registry.

A tiny root filesystem (merged-/usr symlinks, a passwd file, the linker cache) is imported with
`docker import`; at run time the host's /usr, Python and this checkout (with its venv, where Ray
comes from PyPI) are bind-mounted at the same paths. ``vllm`` is the stand-in. The image is
imported once and copied to the other nodes with `docker save | docker load`, which keeps its
ID, so every node has the same image ID as a real cluster should.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
PYTHON_HOME = Path(sys.base_prefix)
BED_IMAGE = "vrd-bed/vllm-ray:1"
OLD_STACK_IMAGE = "vrd-bed/old-stack:1"  # busybox: what the previous model's stack runs


def runtime_mounts() -> list[str]:
    """Bind mounts every bed container needs (docker -v syntax, read-only)."""
    paths = [Path("/usr"), PYTHON_HOME, REPO]
    if not VENV.is_relative_to(REPO):
        paths.append(VENV)
    return [f"{p}:{p}:ro" for p in paths]


def image_changes() -> list[str]:
    path = f"/opt/vrd/bin:{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return [
        f"ENV PATH={path}",
        f"ENV PYTHONPATH={REPO}",
        "ENV RAY_USAGE_STATS_ENABLED=0",
        "ENV PYTHONDONTWRITEBYTECODE=1",
        "ENV HOME=/root",
        "ENV USER=root",
        "WORKDIR /root",
    ]


def rootfs() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, target in (
            ("bin", "usr/bin"),
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
            ("sbin", "usr/sbin"),
        ):
            _symlink(tar, name, target)
        for directory, mode in (
            ("usr", 0o755),
            ("tmp", 0o1777),
            ("root", 0o700),
            ("proc", 0o555),
            ("sys", 0o555),
            ("dev", 0o755),
            ("run", 0o755),
            ("etc", 0o755),
            ("opt/vrd/bin", 0o755),
            ("var/tmp", 0o1777),
        ):
            _dir(tar, directory, mode)
        _file(
            tar,
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
        )
        _file(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        ld_cache = Path("/etc/ld.so.cache")
        if ld_cache.exists():
            _file(tar, "etc/ld.so.cache", ld_cache.read_bytes())
        shim = f'#!/bin/sh\nexec {VENV}/bin/python -m tests.testbed.standins.vllm_standin "$@"\n'
        _file(tar, "opt/vrd/bin/vllm", shim.encode(), 0o755)
    return buf.getvalue()


def busybox_rootfs() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add("/bin/busybox", arcname="bin/busybox")
        for applet in ("sh", "sleep", "cat", "echo", "true", "false", "env", "ls", "timeout"):
            _symlink(tar, f"bin/{applet}", "busybox")
        for directory in ("tmp", "proc", "sys", "dev", "etc"):
            _dir(tar, directory, 0o1777 if directory == "tmp" else 0o755)
    return buf.getvalue()


def _symlink(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    tar.addfile(info)


def _dir(tar: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    tar.addfile(info)


def _file(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))
