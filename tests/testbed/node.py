"""One emulated GPU node: its own sshd (loopback address), Docker engine, GPU state, memory and
units; sshd and the engine run in the node's mount namespace (tests.testbed.namespace)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.testbed import fabric
from tests.testbed.dockerd import DockerEngine
from tests.testbed.memory import NodeMemory
from tests.testbed.namespace import NodeNamespace
from tests.testbed.procs import wait_until
from tests.testbed.sshd import SSHServer, keygen
from tests.testbed.standins import gpu_state, systemctl

STANDINS = Path(__file__).resolve().parent / "standins"
REPO = STANDINS.parents[2]
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class NodeSpec:
    """What the bed records about a node (in bed.json): enough to find and stop it later."""

    name: str
    ip: str
    root: str
    gpu_dir: str
    ssh_port: int = 0
    sshd_pid: int = 0
    dockerd_pid: int = 0
    rdma: str = ""  # a tests.testbed.fabric preset ("both", "one-down", ...); "": no fabric
    rdma_state: str = ""  # the file the node's `rdma` stand-in reads (none: no HCA)
    bus: int = 0  # the PCI bus number in its interface names, unique on the host
    ns_pid: int = 0  # the holder of its mount namespace (0: powered off)


class EmulatedNode:
    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.root = Path(spec.root)
        self.gpu_dir = Path(spec.gpu_dir)
        self.namespace = NodeNamespace(self.root, self.gpu_dir, pid=spec.ns_pid)
        self.engine = DockerEngine(self.root / "d", pid=spec.dockerd_pid)
        self.sshd = SSHServer(
            self.root / "sshd",
            spec.ip,
            [],
            port=spec.ssh_port,
            host_key=self.root / "ssh_host_ed25519_key",
            pid=spec.sshd_pid,
        )
        if spec.ns_pid:
            self.engine.enter = self.sshd.enter = self.namespace.enter()

    name = property(lambda self: self.spec.name)
    ip = property(lambda self: self.spec.ip)

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def rdma_state(self) -> Path:
        return Path(self.spec.rdma_state) if self.spec.rdma_state else self.root / "rdma.json"

    @property
    def fabric(self) -> fabric.NodeFabric | None:
        """The node's emulated fabric hardware (tests.testbed.fabric), if it has any."""
        if not self.spec.rdma or not self.spec.bus:
            return None
        return fabric.NodeFabric(self.spec.rdma, self.spec.bus, self.ip, self.rdma_state)

    @property
    def memory(self) -> NodeMemory:
        """The node's memory (tests.testbed.memory): what its /proc/meminfo shows."""
        return NodeMemory(self.gpu_dir)

    @property
    def units_dir(self) -> Path:
        return self.root / "units"

    @property
    def boot_id_file(self) -> Path:
        """The node's /proc/sys/kernel/random/boot_id: a new uuid4 at every start()."""
        return self.root / "boot_id"

    def env(self) -> dict[str, str]:
        """The node's login environment: what its sshd gives every session."""
        return {
            "PATH": f"{self.bin_dir}:{SYSTEM_PATH}",
            "DOCKER_HOST": self.engine.url,
            "VRD_GPU_STATE": str(self.gpu_dir),
            "VRD_UNITS_DIR": str(self.units_dir),
        }

    def create(self, gpu_profile: str, gpus: int) -> None:
        self.units_dir.mkdir(parents=True, exist_ok=True)
        gpu_state.write_config(self.gpu_dir, gpu_profile, gpus)
        ns = self.namespace
        self.memory.create(gpu_profile, ns.meminfo_file, ns.drop_caches_file)
        self.bin_dir.mkdir(exist_ok=True)
        tools = (
            ("nvidia-smi", "nvidia_smi.py"),
            ("systemctl", "systemctl.py"),
            ("rdma", "rdma.py"),
        )
        for tool, script in tools:
            wrapper = self.bin_dir / tool
            wrapper.write_text(
                "#!/bin/sh\n"
                f"export VRD_GPU_STATE={self.gpu_dir} VRD_UNITS_DIR={self.units_dir}\n"
                f"export VRD_RDMA_STATE={self.rdma_state}\n"
                f'exec {sys.executable} {STANDINS / script} "$@"\n'
            )
            wrapper.chmod(0o755)
        keygen(self.root / "ssh_host_ed25519_key")
        if self.spec.rdma:
            self._create_fabric()

    def _create_fabric(self) -> None:
        if self.spec.rdma not in fabric.PRESETS:
            raise ValueError(f"{self.name}: rdma {self.spec.rdma!r}; one of {fabric.PRESETS}")

        def names(bus: int) -> tuple[str, ...]:
            return fabric.NodeFabric(self.spec.rdma, bus, self.ip, self.rdma_state).host_names()

        self.spec.bus = fabric.allocate_bus(self.root, names)
        assert self.fabric is not None
        self.fabric.create()

    def start(self, client_key: Path, expect_back: list[str] | None = None) -> None:
        """Power on: memory as after boot, the mount namespace, the Docker engine (restart
        policies apply), sshd, then enabled units. ``expect_back``: containers the engine
        restarts by policy; waited for, as a boot is."""
        self.boot_id_file.write_text(f"{uuid.uuid4()}\n")
        self.memory.boot()
        self.namespace.start()
        self.spec.ns_pid = self.namespace.pid
        self.engine.enter = self.sshd.enter = self.namespace.enter()
        self.engine.start()
        if expect_back:
            wait_until(
                lambda: set(expect_back) <= self._running(),
                30,
                f"{self.name}: containers {expect_back} after boot",
            )
        self.sshd.authorized_keys = [client_key]
        self.sshd.env = self.env()
        self.sshd.start()
        self.spec.dockerd_pid, self.spec.ssh_port, self.spec.sshd_pid = (
            self.engine.pid,
            self.sshd.port,
            self.sshd.pid,
        )
        for unit_file in sorted(self.units_dir.glob("*.json")):
            if json.loads(unit_file.read_text())["enabled"]:
                self.systemctl("start", unit_file.stem)

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "systemctl"), *args],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env()},
            check=False,
        )

    def define_unit(self, unit: str, container: str, image: str, command: list[str]) -> None:
        systemctl.define(self.units_dir, unit, container, image, command)

    def hold_gpu(self, mib: int, name: str = "python3") -> subprocess.Popen[str]:
        """Start a stray process on this node that holds ``mib`` of GPU memory until killed (on
        GB10, of the node's memory)."""
        proc = subprocess.Popen(
            [sys.executable, str(STANDINS / "gpu_state.py"), str(self.gpu_dir), str(mib), name],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
        return proc

    def power_off(self) -> None:
        """Everything running on the node stops: SSH sessions, the engine with its containers,
        processes holding its GPUs, its mount namespace. Files (units, images, GPU config, what
        was written to /etc) and the fabric's interfaces and address stay (tests.testbed.fabric)."""
        for unit_file in self.units_dir.glob("*.json"):
            data = json.loads(unit_file.read_text())
            data["active"] = False
            unit_file.write_text(json.dumps(data, indent=1))
        self.sshd.stop()
        self.engine.stop_engine()
        static = {p["pid"] for p in gpu_state.read_config(self.gpu_dir)["static_processes"]}
        for holder in gpu_state.live_processes(self.gpu_dir):
            if holder.pid not in static:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(holder.pid, signal.SIGKILL)
        self.namespace.stop()
        self.spec.sshd_pid = self.spec.dockerd_pid = self.spec.ns_pid = 0

    def reboot(self, client_key: Path) -> None:
        with contextlib.closing(self.engine.client()) as client:
            back = [
                c.name
                for c in client.containers.list()
                if c.attrs["HostConfig"]["RestartPolicy"]["Name"] in ("always", "unless-stopped")
            ]
        self.power_off()
        self.start(client_key, back)

    def stop_sshd(self) -> None:
        """sshd goes away (listener and every session); Docker and containers keep running."""
        self.sshd.stop()
        self.spec.sshd_pid = 0

    def start_sshd(self) -> None:
        """sshd back on the same address, port and host key."""
        self.sshd.start()
        self.spec.sshd_pid = self.sshd.pid

    def restart_docker(self) -> None:
        """`systemctl restart docker`: the engine stops its containers (2 s grace) and comes
        back; containers with a restart policy start again, the others stay exited."""
        with contextlib.closing(self.engine.client()) as client:
            back = [
                c.name
                for c in client.containers.list()
                if c.attrs["HostConfig"]["RestartPolicy"]["Name"] in ("always", "unless-stopped")
            ]
        self.engine.stop_engine(graceful=True)
        self.engine.start()
        self.spec.dockerd_pid = self.engine.pid
        wait_until(lambda: set(back) <= self._running(), 30, f"{self.name}: {back} after a restart")

    def _running(self) -> set[str]:
        with contextlib.closing(self.engine.client()) as client:
            return {c.name for c in client.containers.list()}

    def destroy(self) -> None:
        self.power_off()
        if self.fabric is not None:
            self.fabric.remove()
            fabric.release_bus(self.spec.bus)
        self.engine.remove_data()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.gpu_dir, ignore_errors=True)

    def record(self) -> dict:
        return asdict(self.spec)
