"""The test bed: N emulated GPU nodes on loopback addresses, and a cluster.toml for them.

State lives under one root directory (``bed.json`` records the nodes and daemon PIDs), so the
CLI can bring the bed up in one process and reboot or remove it from another.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.testbed import fabric, hf_cache, image, real_vllm, users
from tests.testbed.node import EmulatedNode, NodeSpec
from tests.testbed.sshd import keygen

DEFAULT_ROOT = Path("/tmp/vrd-bed")
# The bed's own directories its containers see: the emulated GPUs' and HCAs' state, and where a
# test's stand-in writes what the test reads (VRD_EVENT_LOG). Nothing else of the bed's root.
EMULATED = ("gpu", "rdma", "observed")
FIRST_IP = 11  # node-1 is 127.0.0.11, node-2 127.0.0.12, ...
# Every 127.x.y.z is loopback: beds that may run side by side each take their own 127.0.N.0/24:
# pytest-xdist's workers (gw0, gw1, ...) 127.0.40, 127.0.41, ...; VRD_TEST_NET=127.0.M moves a
# whole session (M, M+1, ... for its workers), e.g. a module run beside a full one, or several
# engineers' worktrees on one machine.


def _net() -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else None
    chosen = os.environ.get("VRD_TEST_NET")
    if chosen:
        prefix, _, third = chosen.rpartition(".")
        return f"{prefix}.{int(third) + (index or 0)}"
    return f"127.0.{40 + index}" if index is not None else "127.0.0"


NET = _net()


def bed_ip(last_octet: int) -> str:
    return f"{NET}.{last_octet}"


def ray_port(ip: str) -> int:
    """Ray's GCS listens on every address: each bed's head needs a port of its own."""
    *_, third, fourth = (int(part) for part in ip.split("."))
    return 6000 + (third * 256 + fourth) % 3000


def master_port(ip: str) -> int:
    """vLLM's mp rendezvous listens on every address too: each bed's head needs its own port,
    above the ports tests hand out (procs.TEST_PORTS) and the API's 30000, below the ephemeral
    range (32768)."""
    *_, third, fourth = (int(part) for part in ip.split("."))
    return 30001 + (third * 256 + fourth) % 2700


MAX_NODES = 8
BACKENDS = ("auto", "mp", "ray")
SERVED_NAME = "Qwen3.5-122B-A10B-FP8"
REPO_ID = f"Qwen/{SERVED_NAME}"
MODEL_CONFIG = b'{"architectures": ["Qwen3_5MoeForCausalLM"]}\n'
API_PORT = 30000  # vLLM's port in the config the bed writes, and the old stack's
GPU_TOTAL_MIB = {"h200": 143771, "gb10": 124610}
# What an operator of DGX Sparks sets: vLLM's default 0.9 is more than a Spark has free after boot.
GPU_MEMORY_UTILIZATION = {"gb10": 0.75}


@dataclass
class TestBed:
    __test__ = False  # not a pytest test class

    root: Path = DEFAULT_ROOT
    gpu: str = "h200"
    nodes: list[EmulatedNode] = field(default_factory=list)
    bring_up_s: float = 0.0
    vllm_image: str = image.BED_IMAGE  # the image cluster.toml names (all of BED_IMAGES are loaded)
    # [vllm] backend in cluster.toml: "auto" (the product's default, left out of the file), "mp"
    # or "ray". The bed's images carry Ray, so "auto" takes Ray.
    backend: str = "auto"

    @property
    def client_key(self) -> Path:
        return self.root / "id_controller"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def config_path(self) -> Path:
        return self.root / "cluster.toml"

    @property
    def observed(self) -> Path:
        """Where a stand-in in a container writes what a test or benchmark reads (VRD_EVENT_LOG):
        the one directory of the bed's own that every container sees writable."""
        return self.root / "observed"

    @property
    def hub(self) -> Path:
        """The nodes' Hugging Face cache (``hf download``'s layout), shared as their disk is."""
        return self.root / "hf" / "hub"

    @property
    def model_dir(self) -> Path:
        """The model's snapshot: its files are links into the cache's blobs."""
        repo = hf_cache.repo_dir(self.hub, REPO_ID)
        return repo / "snapshots" / (repo / "refs" / "main").read_text()

    @property
    def model_mount(self) -> str:
        """What the product mounts for the model (its models-- directory), for a test's own
        containers."""
        repo = hf_cache.repo_dir(self.hub, REPO_ID)
        return f"{repo}:{repo}:ro"

    def running(self) -> dict[str, set[str]]:
        """Per node: the names of its running containers."""
        return {node.name: node.running() for node in self.nodes}

    def node(self, name: str) -> EmulatedNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(
            f"no node {name!r} in the bed; nodes: {', '.join(n.name for n in self.nodes)}"
        )

    # --- life cycle -------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        nodes: int = 2,
        gpu: str = "h200",
        root: Path = DEFAULT_ROOT,
        old_stack: bool = True,
        first_ip: int = FIRST_IP,
        vllm_image: str = image.BED_IMAGE,
        rdma: Mapping[str, str] | None = None,
        docker29: Sequence[str] = (),
        sudo: Mapping[str, str] | None = None,
        backend: str = "auto",
    ) -> TestBed:
        """Bring up ``nodes`` nodes at NET.<first_ip>, <first_ip + 1>, ...; beds at other
        addresses can run side by side (Ray and the API bind the nodes' own addresses).
        ``rdma``: node name -> a tests.testbed.fabric preset, e.g. {"node-1": "both"}.
        ``docker29``: the nodes whose engine answers as Docker 29 (tests.testbed.docker29), as
        in a cluster upgraded in part. ``sudo``: node name -> what its login ``nvidia`` may do
        with `sudo -n` (tests.testbed.users): by default all on node-1, on the others only
        stopping and disabling the old stack's unit. ``backend``: [vllm] backend in the
        cluster.toml it writes."""
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be 1..{MAX_NODES}, got {nodes}")
        rdma = dict(rdma or {})
        names = {f"node-{i}" for i in range(1, nodes + 1)}
        if set(rdma) - names or set(rdma.values()) - set(fabric.PRESETS):
            raise ValueError(f"rdma {rdma}: nodes of {sorted(names)}, presets {fabric.PRESETS}")
        if unknown := set(docker29) - names:
            raise ValueError(f"docker29 {sorted(unknown)}: not nodes of {sorted(names)}")
        if (root / "bed.json").exists():
            raise RuntimeError(
                f"a bed already runs at {root}: `python -m tests.testbed down` first"
            )
        started = time.monotonic()
        fabric.sweep()  # interfaces a killed session's RDMA bed left could hold our addresses
        shutil.rmtree(root, ignore_errors=True)
        blocked = [p for p in root.parents if p.exists() and not p.stat().st_mode & 0o001]
        if blocked:
            raise ValueError(f"bed root {root}: {blocked[0]} is closed to others (the login)")
        root.mkdir(parents=True)
        root.chmod(0o755)  # the nodes' login reaches their sockets, tools and GPU state below
        for shared in EMULATED:
            (root / shared).mkdir()
        sudo = {"node-1": "all", **(sudo or {})}
        bed = cls(root=root, gpu=gpu, vllm_image=vllm_image, backend=backend)
        keygen(bed.client_key)
        hf_cache.write_snapshot(bed.hub, REPO_ID, {"config.json": MODEL_CONFIG})
        if vllm_image in real_vllm.IMAGES:
            hf_cache.snapshot_of(real_vllm.model_dir(), bed.hub, real_vllm.REPO_ID)
        bed.nodes = [
            EmulatedNode(
                NodeSpec(
                    f"node-{i}",
                    bed_ip(first_ip + i - 1),
                    str(root / f"n{i}"),
                    str(root / "gpu" / bed_ip(first_ip + i - 1)),
                    rdma=rdma.get(f"node-{i}", ""),
                    rdma_state=str(root / "rdma" / f"{bed_ip(first_ip + i - 1)}.json"),
                    docker29=f"node-{i}" in docker29,
                    sudo=sudo.get(f"node-{i}", "units"),
                )
            )
            for i in range(1, nodes + 1)
        ]
        try:
            bed._parallel(lambda n: n.create(gpu, 1))
            hcas = [len(n.fabric.hca_names) for n in bed.nodes if n.fabric]
            if any(hcas):
                fabric.claim_uverbs(root, max(hcas))
            bed._parallel(lambda n: n.start(bed.client_key))
            bed._install_images()
            if old_stack:
                bed.install_old_stack()
            bed.known_hosts.write_text("".join(n.sshd.known_hosts_line() for n in bed.nodes))
            bed.write_config()
            bed.save()
        except BaseException:
            bed.down()
            raise
        bed.bring_up_s = time.monotonic() - started
        return bed

    def _parallel(self, fn) -> None:  # type: ignore[no-untyped-def]
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            list(pool.map(fn, self.nodes))

    def _install_images(self) -> None:
        """Import each image once on the first node, then copy them all to the others in one
        `docker save | docker load` (same image IDs everywhere)."""
        first = self.nodes[0].engine
        rootfs = image.rootfs()
        made: list[tuple[bytes, str, list[str] | None]] = [
            (rootfs, m.tag, m.changes()) for m in image.BED_IMAGES
        ]
        made.append((image.busybox_rootfs(), image.OLD_STACK_IMAGE, None))
        with ThreadPoolExecutor(max_workers=len(made)) as pool:
            list(pool.map(lambda m: first.import_rootfs(*m), made))
        tags = [tag for _, tag, _ in made]
        save = ["docker", "--host", first.url, "save", *tags]
        bundle = subprocess.run(save, capture_output=True, check=True).stdout
        others = self.nodes[1:]
        with ThreadPoolExecutor(max_workers=max(len(others), 1)) as pool:
            list(pool.map(lambda n: n.engine.load(bundle), others))

    def install_old_stack(self) -> None:
        """What the user's boxes run after a reboot: a previous model's stack that auto-starts,
        from an enabled systemd unit (glm-server.service: a real unit file that runs
        `docker run --rm --name glm-server ...`) and a restart policy (glm-proxy), on every
        node."""
        for node in self.nodes:
            # On the head the old server holds the API port, as the previous model's did.
            serve = ["busybox", "httpd", "-f", "-p", f"{node.ip}:{API_PORT}"]
            command = serve if node is self.nodes[0] else ["sleep", "999999"]
            node.define_unit(image.OLD_STACK_UNIT, "glm-server", image.OLD_STACK_IMAGE, command)
            started = node.systemctl("start", image.OLD_STACK_UNIT)
            if started.returncode != 0:
                raise RuntimeError(f"{node.name}: {image.OLD_STACK_UNIT}: {started.stderr.strip()}")
            with contextlib.closing(node.engine.client()) as client:
                client.containers.run(
                    image.OLD_STACK_IMAGE,
                    ["sleep", "999999"],
                    name="glm-proxy",
                    detach=True,
                    network_mode="host",
                    restart_policy={"Name": "unless-stopped"},
                )
            node.wait_for_containers(["glm-server"])

    def reboot(self, name: str) -> None:
        node = self.node(name)
        node.reboot(self.client_key)
        self.save()

    def down(self) -> None:
        if self.nodes:
            self._parallel(lambda n: n.destroy())
        fabric.release_uverbs(self.root)  # the last bed using them removes /dev/infiniband/uverbs*
        shutil.rmtree(self.root, ignore_errors=True)

    # --- records ------------------------------------------------------------------------------

    def save(self) -> None:
        data = {
            "gpu": self.gpu,
            "image": self.vllm_image,
            "backend": self.backend,
            "nodes": [n.record() for n in self.nodes],
        }
        (self.root / "bed.json").write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, root: Path = DEFAULT_ROOT) -> TestBed:
        path = root / "bed.json"
        if not path.exists():
            raise RuntimeError(f"no bed at {root}: `python -m tests.testbed up` first")
        data = json.loads(path.read_text())
        nodes = [EmulatedNode(NodeSpec(**spec)) for spec in data["nodes"]]
        return cls(
            root=root,
            gpu=data["gpu"],
            nodes=nodes,
            vllm_image=data.get("image", image.BED_IMAGE),
            backend=data.get("backend", "auto"),
        )

    def settings(self) -> dict[str, Any]:
        """The bed's cluster configuration as data, the way an operator describes real nodes.
        Containers see their node's /proc/meminfo, as on a real host (Ray's memory monitor reads
        it); on GB10 the vLLM stand-in uses the node's memory (standins/unified_memory.py)."""
        unified = {"VRD_UNIFIED_MEMORY": "1"} if self.gpu == "gb10" else {}
        util = GPU_MEMORY_UTILIZATION.get(self.gpu)
        settings = {
            "name": "bed",
            "nodes": [
                {
                    "name": n.name,
                    "address": n.ip,
                    "ssh_port": n.spec.ssh_port,
                    "ssh_user": users.LOGIN,
                    "gpus": 1,
                }
                for n in self.nodes
            ],
            "ssh": {
                "key_file": str(self.client_key),
                "known_hosts": str(self.known_hosts),
                "connect_timeout_s": 5,
            },
            "vllm": {
                "image": self.vllm_image,
                "model": str(self.model_dir),
                "served_model_name": SERVED_NAME,
                "port": API_PORT,
                "host": self.nodes[0].ip,  # beds at other addresses can serve side by side
                "tensor_parallel_size": len(self.nodes),
                **({"backend": self.backend} if self.backend != "auto" else {}),
                "master_port": master_port(self.nodes[0].ip),
                "reasoning_parser": "qwen3",
                "gpu_device_request": False,  # no GPUs here: the stand-ins emulate them
                **({"gpu_memory_utilization": util} if util else {}),
                "shm_size": "256m",
                "volumes": [
                    *image.runtime_mounts(),
                    # What emulates the GPUs and HCAs; the model and caches are the product's.
                    *(f"{self.root / d}:{self.root / d}" for d in EMULATED),
                    *(f"{n.root / 'proc'}:{n.root / 'proc'}" for n in self.nodes),  # meminfo
                    "/proc/meminfo:/proc/meminfo:ro",
                ],
                "env": {
                    **unified,
                    "VRD_BED_ROOT": str(self.root),
                    "VRD_GPU_TOTAL_MIB": str(GPU_TOTAL_MIB[self.gpu]),
                    "VRD_LOAD_SECONDS": "3",
                },
            },
            # The nodes share this machine's disk: one directory for the bed, never /var/cache.
            "cache": {"dir": str(self.root / "compile-cache")},
            # Ray's GCS listens on all addresses: beds side by side need their own port.
            "ray": {
                "port": ray_port(self.nodes[0].ip),
                "object_store_bytes": 78643200,  # Ray's smallest
                "extra_args": ["--num-cpus=1"],
            },
            "autostart": {"containers": ["glm-*"], "units": [image.OLD_STACK_UNIT]},
            "deadlines": {
                "model_load_s": 120,
                "nodes_reachable_s": 60,
                "gpu_release_s": 5,
                # The product's default: 8 Ray nodes joining on 2 busy cores take more than 60 s.
                "ray_cluster_s": 120,
            },
        }
        if self.vllm_image in real_vllm.IMAGES:
            return real_vllm.settings(settings, self.hub)
        return settings

    def write_config(self, path: Path | None = None, **changes: dict[str, Any]) -> Path:
        """Write cluster.toml (or ``path``); ``changes`` are merged into the sections by key,
        e.g. ``vllm={"env": {...}}`` or ``nodes={"node-2": {"fabric_ip": ...}}``; a key given
        None is left out (its default then)."""
        data = self.settings()
        for section, values in changes.items():
            if section == "nodes":
                for node in data["nodes"]:
                    node.update(values.get(node["name"], {}))
            elif isinstance(data.get(section), dict):
                for key, value in values.items():
                    if isinstance(value, dict) and isinstance(data[section].get(key), dict):
                        data[section][key] = {**data[section][key], **value}
                    elif value is None:
                        data[section].pop(key, None)
                    else:
                        data[section][key] = value
            else:
                data[section] = values
        path = path or self.config_path
        path.write_text(to_toml(data))
        return path


def to_toml(data: dict[str, Any]) -> str:
    """Enough TOML for the bed's configuration: scalars, lists, tables, arrays of tables."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                lines += ["", f"[[{key}]]", *_pairs(item)]
        else:
            lines.append(f"{key} = {_value(value)}")
    for name, table in tables:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines += ["", f"[{name}]", *_pairs(scalars)]
        for sub, values in table.items():
            if isinstance(values, dict):
                lines += ["", f"[{name}.{sub}]", *_pairs(values)]
    return "\n".join(lines) + "\n"


def _pairs(table: dict[str, Any]) -> list[str]:
    return [f"{k} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict)]


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string
