"""One emulated GPU node: its own sshd (loopback address), Docker engine, GPU state, memory and
units; sshd and the engine run in the node's mount namespace (tests.testbed.namespace).

Its systemd units are real unit files in its own /etc/systemd/system (none of the host's), run by
the ``systemctl`` stand-in (standins/systemctl.py): what a test or the product installs there is
what runs, and the node's boot starts the enabled ones after Docker and sshd, as systemd does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.testbed import fabric, image, users
from tests.testbed.docker29 import DockerGate
from tests.testbed.dockerd import DockerEngine
from tests.testbed.memory import NodeMemory
from tests.testbed.namespace import NodeNamespace
from tests.testbed.procs import kill_tree, pids_with_arg, wait_until
from tests.testbed.sshd import SSHServer, keygen
from tests.testbed.standins import gpu_state

STANDINS = Path(__file__).resolve().parent / "standins"
REPO = STANDINS.parents[2]
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The host tools' stand-ins run as the node's login too: with an interpreter it may run (this
# one's may sit below /root, which is 0700) from a copy below the node's root (the repository
# may be unreadable to others).
HOST_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


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
    docker29: bool = False  # its engine answers as Docker 29 (tests.testbed.docker29)
    gate_pid: int = 0
    sudo: str = "all"  # what its login may do with `sudo -n` (tests.testbed.users)


class EmulatedNode:
    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.root = Path(spec.root)
        self.gpu_dir = Path(spec.gpu_dir)
        self.namespace = NodeNamespace(self.root, self.gpu_dir, pid=spec.ns_pid)
        self.engine = DockerEngine(self.root / "d", pid=spec.dockerd_pid)
        self.gate = (
            DockerGate(self.root / "docker29.sock", self.engine.socket, self.root / "docker29.log",
                       pid=spec.gate_pid)
            if spec.docker29
            else None
        )  # fmt: skip
        self.sshd = SSHServer(
            self.root / "sshd",
            spec.ip,
            [],
            port=spec.ssh_port,
            host_key=self.root / "ssh_host_ed25519_key",
            pid=spec.sshd_pid,
        )
        if spec.ns_pid:
            self._enter()

    def _enter(self) -> None:
        self.engine.enter = self.sshd.enter = self.namespace.enter()
        if self.gate is not None:
            self.gate.enter = self.engine.enter

    @property
    def docker_url(self) -> str:
        """Where the node's own docker CLI and everything on it reach Docker."""
        return self.gate.url if self.gate is not None else self.engine.url

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
    def systemd_dir(self) -> Path:
        """The node's /run/systemd for the systemctl stand-in (what it loaded, unit states):
        emptied at power-off, as a tmpfs is."""
        return self.root / "systemd"

    @property
    def journal_dir(self) -> Path:
        """The node's journal (standins/journal.py); it outlives reboots."""
        return self.root / "journal"

    @property
    def boot_id_file(self) -> Path:
        """The node's /proc/sys/kernel/random/boot_id: a new uuid4 at every start()."""
        return self.namespace.boot_id_file

    def env(self) -> dict[str, str]:
        """The node's login environment: what its sshd gives every session."""
        return {
            "PATH": f"{self.bin_dir}:{SYSTEM_PATH}",
            "DOCKER_HOST": self.docker_url,
            "VRD_GPU_STATE": str(self.gpu_dir),
        }

    def create(self, gpu_profile: str, gpus: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # the login reaches its Docker socket and tools below it
        gpu_state.write_config(self.gpu_dir, gpu_profile, gpus)
        ns = self.namespace
        self.memory.create(gpu_profile, ns.meminfo_file, ns.drop_caches_file)
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        standins = self.root / "standins"
        shutil.copytree(STANDINS, standins, ignore=shutil.ignore_patterns("__pycache__"))
        tools = (
            ("nvidia-smi", "nvidia_smi.py"),
            ("systemctl", "systemctl.py"),
            ("journalctl", "journal.py"),
            ("rdma", "rdma.py"),
        )
        for tool, script in tools:
            wrapper = self.bin_dir / tool
            wrapper.write_text(
                "#!/bin/sh\n"
                f"export VRD_GPU_STATE={self.gpu_dir} VRD_RDMA_STATE={self.rdma_state}\n"
                f"export VRD_SYSTEMD_RUN={self.systemd_dir} VRD_JOURNAL={self.journal_dir}\n"
                f"export VRD_NODE_NAME={self.name}\n"
                f'exec {HOST_PYTHON} {standins / script} "$@"\n'
            )
            wrapper.chmod(0o755)
        self._create_systemd()
        users.write_login(
            ns.upper("/etc"),
            ns.upper("/home"),
            self.spec.sudo,
            self.bin_dir,
            [image.OLD_STACK_UNIT],
            SYSTEM_PATH,
        )
        keygen(self.root / "ssh_host_ed25519_key")

    def _create_systemd(self) -> None:
        """The node's own systemd configuration, written before its namespace first runs."""
        etc = self.namespace.upper("/etc")
        units = etc / "systemd" / "system"
        units.mkdir(parents=True, exist_ok=True)
        # Opaque: the host's /etc/systemd/system (its docker, ssh, ... enabled) is not the node's.
        os.setxattr(units, "trusted.overlay.opaque", b"y")
        # As on a host whose docker CLI reaches the node's engine: units get DOCKER_HOST.
        (etc / "systemd" / "system.conf").write_text(
            f"[Manager]\nDefaultEnvironment=DOCKER_HOST={self.docker_url}\n"
        )
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
        self._enter()
        self.engine.start()
        if self.gate is not None:
            self.gate.start()
            self.spec.gate_pid = self.gate.pid
        if expect_back:
            wait_until(
                lambda: set(expect_back) <= self.running(),
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
        self._start_enabled_units()

    def _start_enabled_units(self) -> None:
        """systemd at boot: every unit multi-user.target wants, loaded afresh (the vendor units
        under /usr/lib are the host's, none of them this node's)."""
        wants = self.run(["ls", "-1", "/etc/systemd/system/multi-user.target.wants"])
        enabled = [name for name in wants.stdout.split() if name.endswith(".service")]
        if not enabled:
            return
        started = self.systemctl("start", *enabled)
        if started.returncode != 0:
            print(f"{self.name}: at boot: {started.stderr.strip()}", file=sys.stderr)
        self.wait_for_containers([c for u, c in self._docker_units().items() if u in enabled])

    def wait_for_containers(self, names: list[str], timeout: float = 30) -> None:
        """Until the containers ``names`` run (a unit's `docker run` starts its own in a while);
        when they never do, the error quotes the journal of the units that start them."""
        try:
            wait_until(lambda: set(names) <= self.running(), timeout, f"{self.name}: {names}")
        except TimeoutError as exc:
            units = [u for u, container in self._docker_units().items() if container in names]
            if not units:
                raise
            journal = self.run(["journalctl", "-n", "15", *(f"-u{u}" for u in units)]).stdout
            raise TimeoutError(f"{exc}; journal of {', '.join(units)}:\n{journal}") from None

    def run(self, argv: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on the node as root, in its view of the filesystem (no SSH)."""
        return subprocess.run(
            [*self.namespace.enter(), *argv],
            input=stdin.decode() if stdin is not None else None,
            capture_output=True,
            text=True,
            env={**os.environ, **self.env()},
            check=False,
        )

    def own_dir(self, path: Path, tmpfs_size: str | None = None) -> Path:
        """Make ``path`` this node's own until it powers off, as a directory on a disk of its
        own: a directory under its root (returned: the host's view of it) bind-mounted there in
        its namespace, or, with ``tmpfs_size``, a small filesystem (a disk nearly full). It
        belongs to the node's login, as a user's own disk does."""
        own = self.root / "own" / str(path).strip("/").replace("/", "-")
        own.mkdir(parents=True, exist_ok=True)
        uid, gid = users.login_ids()
        os.chown(own, uid, gid)
        path.mkdir(parents=True, exist_ok=True)
        if tmpfs_size:
            options = f"size={tmpfs_size},uid={uid},gid={gid},mode=0755"
            mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
        else:
            mount = ["mount", "--bind", str(own), str(path)]
        done = self.run(mount)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(mount)}: {done.stderr.strip()}")
        return own

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.bin_dir / "systemctl"), *args])

    def write_file(self, path: str, content: str, mode: int = 0o644) -> None:
        """Write ``path`` as a process on the (running) node would: below its /etc or
        /usr/local it stays on this node."""
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" "$1"'
        done = self.run(["sh", "-c", script, "sh", path, f"{mode:o}"], content.encode())
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: writing {path}: {done.stderr.strip()}")

    def define_unit(
        self, unit: str, container: str, image: str, command: list[str], enable: bool = True
    ) -> None:
        """A unit file in the node's /etc/systemd/system that runs ``command`` in a container
        (what a previous model's stack installed), enabled as `systemctl enable` does."""
        self.write_file(f"/etc/systemd/system/{unit}", docker_unit(container, image, command))
        units = {**self._docker_units(), unit: container}
        (self.root / "docker-units.json").write_text(json.dumps(units))
        done = self.systemctl("enable", unit) if enable else self.systemctl("daemon-reload")
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {unit}: {done.stderr.strip()}")

    def _docker_units(self) -> dict[str, str]:
        """The units define_unit made: unit -> its container (a boot waits for them)."""
        path = self.root / "docker-units.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def nvidia_smi_answers_in(self, seconds: float) -> None:
        """Each nvidia-smi call on this node takes ``seconds`` from now (0: at once)."""
        self._gpu_config(answer_s=seconds)

    def nvidia_smi_faults(self, inforom_corrupted: tuple[int, ...] = (), garbage: str = "") -> None:
        """nvidia-smi on this node from now: the GPUs in ``inforom_corrupted`` warn of it (exit
        14, the answer in full), and ``garbage`` is a line appended to its answer; none of
        either when left out."""
        self._gpu_config(inforom_corrupted=list(inforom_corrupted), garbage=garbage)

    def _gpu_config(self, **values: object) -> None:
        config = gpu_state.read_config(self.gpu_dir)
        config.update(values)
        tmp = self.gpu_dir / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=1))
        tmp.replace(self.gpu_dir / "config.json")

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
        # The units' processes (each under a supervisor that names the run directory).
        for supervisor in pids_with_arg(str(self.systemd_dir)):
            kill_tree(supervisor, grace=0)
        shutil.rmtree(self.systemd_dir, ignore_errors=True)
        self.sshd.stop()
        if self.gate is not None:
            self.gate.stop()
            self.spec.gate_pid = 0
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
        wait_until(lambda: set(back) <= self.running(), 30, f"{self.name}: {back} after a restart")

    def running(self) -> set[str]:
        """The names of the containers running on this node."""
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


def docker_unit(container: str, image: str, command: list[str]) -> str:
    """A unit file like those that start a container at boot; ``docker run`` stays attached,
    so the unit is active while the container runs."""
    docker = shutil.which("docker") or "/usr/bin/docker"
    # --init: the command is not PID 1 and dies of `docker stop`'s SIGTERM, at once, not in 10 s.
    run = [docker, "run", "--rm", "--init", "--name", container, "--network", "host", image]
    return "\n".join(
        [
            "[Unit]",
            f"Description={container} (a previous model's stack)",
            "After=docker.service",
            "",
            "[Service]",
            f"ExecStartPre=-{docker} rm -f {container}",
            f"ExecStart={_exec_line([*run, *command])}",
            f"ExecStop={docker} stop {container}",
            # `docker run` exits with the container's status: 143 when `docker stop` ended it.
            "SuccessExitStatus=143",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def _exec_line(argv: list[str]) -> str:
    """A command line for an Exec*= setting: quoted words, with % and $ kept literal."""
    return shlex.join(argv).replace("%", "%%").replace("$", "$$")
