"""Emulated GPU state of one test-bed node, shared by the nvidia-smi stand-in and GPU "holders".

Layout of a node's GPU state directory (``VRD_GPU_STATE``):

- ``config.json``: ``{"profile": "h200" | "gb10", "gpus": 1, "static_processes": [...]}``;
  static processes are always listed (e.g. Xorg on a GB10 desktop, type "G"). Optional keys,
  read by the nvidia-smi stand-in: ``"uuids"`` (one ``"GPU-..."`` per GPU, by index; derived
  from the directory when absent), ``"driver_version"`` and ``"cuda_version"`` (strings;
  the profile's defaults when absent), ``"answer_s"`` (how long each call takes before it
  answers, as a busy driver's does; 0 when absent).
- ``procs/<token>.json``: one file per live process holding GPU memory:
  ``{"pid": int, "name": str, "used_mib": int, "type": "C" | "G", "gpu": int}``.
  The holder keeps the file open with an exclusive ``flock`` for as long as it lives. A reader
  that can take the lock knows the holder is gone (even after SIGKILL) and ignores the entry.
  The holder's host PID is found by scanning ``/proc/*/fd`` for the open file, because a holder
  inside a container only knows its PID in the container's namespace.

Only the standard library is used: this runs inside test containers and as nvidia-smi.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_STATE = "VRD_GPU_STATE"
PROFILES = ("h200", "gb10")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int
    type: str = "C"  # C compute, G graphics, C+G both
    gpu: int = 0


def state_dir(path: str | os.PathLike[str] | None = None) -> Path:
    value = path or os.environ.get(ENV_STATE)
    if not value:
        raise RuntimeError(f"{ENV_STATE} is not set: which node's GPU state?")
    return Path(value)


def write_config(
    directory: Path,
    profile: str = "h200",
    gpus: int = 1,
    static_processes: list[GpuProcess] | None = None,
) -> None:
    if profile not in PROFILES:
        raise ValueError(f"unknown GPU profile {profile!r}; one of {PROFILES}")
    (directory / "procs").mkdir(parents=True, exist_ok=True)
    data = {
        "profile": profile,
        "gpus": gpus,
        "static_processes": [asdict(p) for p in static_processes or []],
    }
    (directory / "config.json").write_text(json.dumps(data, indent=1))


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


class Registration:
    """This process holds ``used_mib`` of GPU ``gpu`` while the registration is open."""

    def __init__(
        self, directory: Path, name: str, used_mib: int, type_: str = "C", gpu: int = 0
    ) -> None:
        procs = directory / "procs"
        procs.mkdir(parents=True, exist_ok=True)
        self.path = procs / f"{uuid.uuid4().hex}.json"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        entry = GpuProcess(os.getpid(), name, used_mib, type_, gpu)
        os.write(self._fd, json.dumps(asdict(entry)).encode())
        os.fsync(self._fd)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def register(
    directory: Path, name: str, used_mib: int, type_: str = "C", gpu: int = 0
) -> Registration:
    return Registration(directory, name, used_mib, type_, gpu)


def live_processes(directory: Path) -> list[GpuProcess]:
    """Static processes plus every registration whose holder is still alive, by host PID."""
    config = read_config(directory)
    found = [GpuProcess(**p) for p in config.get("static_processes", [])]
    procs = directory / "procs"
    entries: dict[str, GpuProcess] = {}
    for path in sorted(procs.glob("*.json")) if procs.exists() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: the holder is alive
                data = json.loads(os.read(fd, 65536) or b"{}")
                if data:
                    entries[path.stem] = GpuProcess(**data)
                continue
            # Lock was free: the holder died without cleaning up (only root may clear it: a
            # user's nvidia-smi just leaves it out).
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
        finally:
            os.close(fd)
    host_pids = _host_pids(set(entries))
    for token, entry in entries.items():
        pid = host_pids.get(token, entry.pid)
        found.append(GpuProcess(pid, entry.name, entry.used_mib, entry.type, entry.gpu))
    return found


def _host_pids(tokens: set[str]) -> dict[str, int]:
    """Map registration tokens to the host PIDs that hold them open."""
    result: dict[str, int] = {}
    if not tokens:
        return result
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.endswith(".json"):
                        token = Path(target).stem
                        if token in tokens and token not in result:
                            result[token] = int(proc.name)
        if len(result) == len(tokens):
            break
    return result


def _hold(argv: list[str]) -> None:
    """``python gpu_state.py DIR MIB NAME``: a stray process holding GPU memory until killed;
    on a unified-memory node (GB10) that memory is the node's (tests.testbed.memory)."""
    import signal
    import time

    directory, mib, name = Path(argv[0]), int(argv[1]), argv[2]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with register(directory, name, mib), contextlib.ExitStack() as stack:
        try:
            from tests.testbed import memory
        except ImportError:  # run outside the repository: GPU memory only
            memory = None  # type: ignore[assignment]
        if memory is not None:
            node = memory.NodeMemory(directory)
            if node.exists() and node.unified:
                stack.callback(node.hold(name, mib * 1024).release)
        print("holding", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    import sys

    _hold(sys.argv[1:])
