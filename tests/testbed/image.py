"""The test bed's images for Ray and vLLM containers, made without a registry.

A tiny root filesystem (merged-/usr symlinks, a passwd file, the linker cache) is imported with
`docker import`; at run time the host's /usr, Python and this checkout (with its venv, where Ray
comes from PyPI) are bind-mounted at the same paths. ``vllm`` is the stand-in. Each image is
imported once and copied to the other nodes with `docker save | docker load`, which keeps its
ID, so every node has the same image ID as a real cluster should.

The images take the shapes of the real ones (BED_IMAGES): a community build without ENTRYPOINT,
vllm/vllm-openai (``ENTRYPOINT ["vllm", "serve"]``) with Ray (up to vLLM 0.17) and without it
(vLLM 0.18 on; one more of that shape runs the real vLLM: tests/testbed/real_vllm.py), and NGC's
nvcr.io/nvidia/vllm, whose entrypoint prints a banner, then runs the command. They share one root
filesystem (one layer to copy) and differ in their configuration:
without Ray, PATH leaves out the venv and leads to a `python3` that is the base interpreter with
only its standard library (``-S``), so neither `ray` nor `import ray` is found.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tests.testbed import real_vllm
from tests.testbed.standins import loaders

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
PYTHON_HOME = Path(sys.base_prefix)
BED_IMAGE = "vrd-bed/vllm-ray:1"  # a community build: no ENTRYPOINT, Ray installed
VLLM_OPENAI_IMAGE = "vrd-bed/vllm-openai:1"
NGC_IMAGE = "vrd-bed/ngc-vllm:1"
NO_RAY_IMAGE = "vrd-bed/vllm-openai-noray:1"
# Images whose Python has the fast weight loaders (stand-in packages: tests/testbed/standins/
# loaders.py reads --load-format against them): both, as eugr's spark-vllm-docker image installs
# them, without Ray; and fastsafetensors alone, with Ray.
LOADERS_IMAGE = "vrd-bed/vllm-loaders:1"
FASTSAFETENSORS_IMAGE = "vrd-bed/vllm-fastsafetensors-ray:1"
# A community build of a vLLM older than its own multi-node launcher (no --nnodes), with Ray. The
# version is the image's, as a real one's is: what the image is asked is cached by its ID.
OLD_VLLM_IMAGE = "vrd-bed/vllm-0.10-ray:1"
OLD_VLLM = "0.10.2"
LOADERS_DIR = "/opt/vrd/loaders"  # one directory per loader, each holding its package
OLD_STACK_IMAGE = "vrd-bed/old-stack:1"  # busybox: what the previous model's stack runs
OLD_STACK_UNIT = "glm-server.service"  # what the previous stack starts at boot
NGC_ENTRYPOINT = "/opt/nvidia/nvidia_entrypoint.sh"
# NGC's script puts the CUDA forward-compatibility libraries first on the library path; on a GB10
# (a driver older than the image's CUDA) vLLM fails FlashInfer's JIT without them.
CUDA_COMPAT = "/usr/local/cuda/compat/lib.real"
NO_RAY_BIN = "/opt/vrd/noray/bin"  # `vllm` and a `python3` without site-packages
# NGC's entrypoint in its real structure (tests/fixtures/ngc: its parts in entrypoint.d, the
# banner, the if/else ending over five lines).
NGC_FIXTURES = REPO / "tests" / "fixtures" / "ngc"
NGC_SCRIPT = NGC_FIXTURES / "nvidia_entrypoint.multiline.sh"


@dataclass(frozen=True)
class BedImage:
    tag: str
    entrypoint: tuple[str, ...] | None  # the image's ENTRYPOINT; None: it declares none
    ray: bool  # Ray runs in it: `ray` on PATH and `import ray` in its Python
    bin_dir: str | None = None  # first on PATH: where its `vllm` is (default: the stand-in's)
    env: tuple[str, ...] = ()  # more ENV lines: KEY=VALUE
    loaders: tuple[str, ...] = ()  # the fast weight loaders its Python imports

    def changes(self) -> list[str]:
        changes = image_changes(self.ray, self.bin_dir) + [f"ENV {e}" for e in self.env]
        if self.loaders:
            paths = ":".join(f"{LOADERS_DIR}/{name}" for name in self.loaders)
            changes.append(f"ENV PYTHONPATH={REPO}:{paths}")
        if self.entrypoint is not None:
            changes.append(f"ENTRYPOINT {json.dumps(list(self.entrypoint))}")
        return changes


BED_IMAGES = (
    BedImage(BED_IMAGE, None, ray=True),
    BedImage(VLLM_OPENAI_IMAGE, ("vllm", "serve"), ray=True),
    # As on a GB10: the stand-in fails like FlashInfer's JIT unless the script's library path
    # reaches it (VRD_NEEDS_LIBRARY, a stand-in knob).
    BedImage(NGC_IMAGE, (NGC_ENTRYPOINT,), ray=True, env=(f"VRD_NEEDS_LIBRARY={CUDA_COMPAT}",)),
    BedImage(NO_RAY_IMAGE, ("vllm", "serve"), ray=False),
    BedImage(
        LOADERS_IMAGE, ("vllm", "serve"), ray=False, loaders=("instanttensor", "fastsafetensors")
    ),
    BedImage(FASTSAFETENSORS_IMAGE, None, ray=True, loaders=("fastsafetensors",)),
    BedImage(OLD_VLLM_IMAGE, None, ray=True, env=(f"VRD_VLLM_VERSION={OLD_VLLM}",)),
    # The real vLLM (CPU build, tests/testbed/real_vllm.py), mounted from where it is installed.
    BedImage(real_vllm.IMAGE, ("vllm", "serve"), ray=False, bin_dir=str(real_vllm.bin_dir())),
    BedImage(real_vllm.NGC_IMAGE, (NGC_ENTRYPOINT,), ray=False, bin_dir=str(real_vllm.bin_dir())),
)


def runtime_mounts() -> list[str]:
    """Bind mounts every bed container needs (docker -v syntax, read-only)."""
    paths = [Path("/usr"), PYTHON_HOME, REPO]
    if not VENV.is_relative_to(REPO):
        paths.append(VENV)
    return [f"{p}:{p}:ro" for p in paths]


def image_changes(ray: bool = True, bin_dir: str | None = None) -> list[str]:
    bins = f"/opt/vrd/bin:{VENV}/bin" if ray else NO_RAY_BIN
    if bin_dir:
        bins = f"{bin_dir}:{NO_RAY_BIN}"
    path = f"{bins}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
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
            (NO_RAY_BIN.lstrip("/"), 0o755),
            ("opt/nvidia", 0o755),
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
        for bin_dir, python in (
            ("opt/vrd/bin", f"{VENV}/bin/python"),
            (NO_RAY_BIN.lstrip("/"), f"{NO_RAY_BIN}/python3"),
        ):
            shim = f'#!/bin/sh\nexec {python} -m tests.testbed.standins.vllm_standin "$@"\n'
            _file(tar, f"{bin_dir}/vllm", shim.encode(), 0o755)
        bare = f'#!/bin/sh\nexec {PYTHON_HOME}/bin/python3 -S "$@"\n'
        _file(tar, f"{NO_RAY_BIN.lstrip('/')}/python3", bare.encode(), 0o755)
        _file(tar, NGC_ENTRYPOINT.lstrip("/"), NGC_SCRIPT.read_bytes(), 0o755)
        _dir(tar, LOADERS_DIR.lstrip("/"), 0o755)
        for name in loaders.FAST:
            package = f"{LOADERS_DIR.lstrip('/')}/{name}/{name}"
            _dir(tar, package.rsplit("/", 1)[0], 0o755)
            _dir(tar, package, 0o755)
            _file(tar, f"{package}/__init__.py", b'"""A stand-in: imports, loads nothing."""\n')
        _dir(tar, "opt/nvidia/entrypoint.d", 0o755)
        for part in sorted((NGC_FIXTURES / "entrypoint.d").iterdir()):
            _file(tar, f"opt/nvidia/entrypoint.d/{part.name}", part.read_bytes(), 0o644)
    return buf.getvalue()


def busybox_rootfs() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add("/bin/busybox", arcname="bin/busybox")
        applets = ("sh", "sleep", "cat", "echo", "true", "false", "env", "ls", "timeout", "sync")
        applets += ("chown",)  # the compile cache handed to an image's user (tasks/cache_dir.py)
        for applet in applets:
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
