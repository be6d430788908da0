"""A node's own view of the filesystem: one mount and IPC namespace per emulated node.

A holder process per node (``unshare --mount --ipc --propagation private``; the node's root is in
its argv, so procs.sweep_abandoned finds it after a killed session) mounts, in its namespace only:

- /etc, /usr/local and /home: overlays on the host's whose upper dirs live under the node's root,
  so what is written there stays on that node, across reboots, like a disk (its accounts and its
  login's home: tests.testbed.users);
- /proc/meminfo and /proc/sys/vm/drop_caches: the node's files (tests.testbed.memory);
- /proc/sys/kernel/random/boot_id: the node's, new at each of its boots;
- /dev/shm: a tmpfs of the node's own, new at each boot, with System V IPC of its own: two real
  hosts never share shared memory. The real vLLM tells ranks on one host from ranks on others by
  whether a shared-memory segment one creates can be opened by the other; with the machine's
  /dev/shm shared by every node, ranks on two nodes took each other for local and waited for ever.
  Containers run with ``ipc_mode="host"``, which is their node's.

The node's sshd and dockerd start inside it (:meth:`NodeNamespace.enter` prefixes their command),
so SSH sessions, the engine and the host paths of its bind mounts all see the node's view. The
network namespace and /dev stay the host's. The holder then is the node's memory watcher until
power-off kills it; the namespace and its mounts end with the last process inside.

The holder is a shell that mounts, then execs the watcher,
``python -m tests.testbed.namespace NODE_ROOT MEMORY_DIR``, which says ready once it watches: a
drop_caches written before that would wait for it, where the kernel's takes effect at once.
"""

from __future__ import annotations

import os
import select
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.testbed import memory
from tests.testbed.procs import kill_tree

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ("/etc", "/usr/local", "/home")
READY = b"ready\n"
SHM_SIZE = "4g"  # an upper bound: tmpfs takes memory only for what is written


@dataclass
class NodeNamespace:
    root: Path  # the node's root directory
    memory_dir: Path  # where the node's memory model lives (its GPU state directory)
    pid: int = 0  # the holder's

    @property
    def meminfo_file(self) -> Path:
        return self.root / "proc" / "meminfo"

    @property
    def drop_caches_file(self) -> Path:
        return self.root / "proc" / "drop_caches"

    @property
    def boot_id_file(self) -> Path:
        return self.root / "boot_id"

    @property
    def log(self) -> Path:
        return self.root / "namespace.log"

    def _layer(self, target: str) -> Path:
        return self.root / "fs" / target.strip("/").replace("/", "-")

    def upper(self, target: str) -> Path:
        """Where the node's own files below ``target`` (one of OVERLAYS) live on the host; write
        there only while the namespace is not running."""
        return self._layer(target) / "upper"

    def mounts(self) -> list[list[str]]:
        commands = []
        for target in OVERLAYS:
            layer = self._layer(target)
            options = f"lowerdir={target},upperdir={layer / 'upper'},workdir={layer / 'work'}"
            commands.append(["mount", "-t", "overlay", "overlay", "-o", options, target])
        commands.append(["mount", "--bind", str(self.meminfo_file), "/proc/meminfo"])
        commands.append(["mount", "--bind", str(self.drop_caches_file), "/proc/sys/vm/drop_caches"])
        boot_id = "/proc/sys/kernel/random/boot_id"
        commands.append(["mount", "--bind", str(self.boot_id_file), boot_id])
        shm = f"size={SHM_SIZE},mode=1777"
        commands.append(["mount", "-t", "tmpfs", "-o", shm, "tmpfs", "/dev/shm"])
        return commands

    def start(self, timeout: float = 10.0) -> None:
        for target in OVERLAYS:
            for part in ("upper", "work"):
                (self._layer(target) / part).mkdir(parents=True, exist_ok=True)
        watcher = [sys.executable, "-S", "-m", "tests.testbed.namespace"]
        script = "\n".join(
            ["set -e", *map(shlex.join, self.mounts()),
             f"exec {shlex.join(watcher)} {shlex.quote(str(self.root))} "
             f"{shlex.quote(str(self.memory_dir))}"]
        )  # fmt: skip
        argv = ["unshare", "--mount", "--ipc", "--propagation", "private", "--", "sh", "-c", script]
        with self.log.open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                start_new_session=True,  # outlives a CLI that brings the bed up
            )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line != READY:
            kill_tree(proc.pid, grace=0)
            tail = self.log.read_text(errors="replace").splitlines()[-10:]
            raise RuntimeError(f"mount namespace of {self.root} not ready:\n" + "\n".join(tail))
        self.pid = proc.pid

    def enter(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        if not self.pid:
            raise RuntimeError(f"the mount namespace of {self.root} is not running")
        return ["nsenter", f"--target={self.pid}", "--mount", "--ipc", "--"]

    def stop(self) -> None:
        if self.pid:
            kill_tree(self.pid, grace=0)
            self.pid = 0


def _say_ready() -> None:
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


if __name__ == "__main__":
    memory.watch(Path(sys.argv[2]), ready=_say_ready)
