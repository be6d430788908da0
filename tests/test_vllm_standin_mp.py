"""vLLM's own multi-node launcher in the vLLM stand-in (``--nnodes``, the "mp" executor, no Ray).

Each node is a real `vllm serve` stand-in process on its own loopback address of this session's
net, with its own emulated GPU state; the ranks meet over real TCP on the leader's master port.
The last test runs the leader and a follower as containers of the bed's image without Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_bed
from tests.test_vllm_standin import MODEL, Standin, _env_without_ray, status
from tests.testbed import image
from tests.testbed.bed import TestBed, bed_ip
from tests.testbed.procs import free_port, stop, wait_until
from tests.testbed.standins import gpu_state

pytestmark = pytest.mark.integration

NODE_IPS = [bed_ip(181 + i) for i in range(4)]
NOBODY = bed_ip(189)  # an address no one listens on
REPO = Path(__file__).resolve().parent.parent
RENDEZVOUS_S = 3
STARTED = "Application startup complete."
WORKERPROC = (
    "Exception: WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause."
)
ENGINE_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore_DP0': 1}"
)


@dataclass
class MpCluster:
    """Stand-ins of one mp launch, each on its node's address; stopped at teardown."""

    workdir: Path
    master_port: int = field(default_factory=lambda: free_port("0.0.0.0"))
    api_port: int = field(default_factory=lambda: free_port(NODE_IPS[0]))
    started: list[Standin] = field(default_factory=list)

    def gpu(self, rank: int) -> Path:
        state = self.workdir / f"gpu-{rank}"
        if not (state / "config.json").exists():
            gpu_state.write_config(state)
        return state

    def start(
        self,
        rank: int,
        nnodes: int = 2,
        *flags: str,
        master_addr: str | None = NODE_IPS[0],
        env: dict[str, str] | None = None,
        short: bool = False,
    ) -> Standin:
        """Node ``rank`` of ``nnodes`` (TP = nnodes); ``short``: vLLM's short flags and
        underscores, which its parser takes too."""
        ip = NODE_IPS[rank]
        n, r, addr, port = (
            ("-n", "-r", "--master_addr", "--master_port")
            if short
            else ("--nnodes", "--node-rank", "--master-addr", "--master-port")
        )
        argv = [
            sys.executable, "-m", "tests.testbed.standins.vllm_standin", "serve", MODEL,
            "--host", ip, "--port", str(self.api_port), "--tensor-parallel-size", str(nnodes),
            n, str(nnodes), r, str(rank), port, str(self.master_port),
            *([addr, master_addr] if master_addr else []),
            *(["--headless"] if rank else []), *flags,
        ]  # fmt: skip
        base = {
            "VLLM_HOST_IP": ip,
            gpu_state.ENV_STATE: str(self.gpu(rank)),
            "VRD_LOAD_SECONDS": "1",
            "VRD_RENDEZVOUS_TIMEOUT": str(RENDEZVOUS_S),
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "PYTHONUNBUFFERED": "1",
        }
        return self._spawn(argv, {**base, **(env or {})}, ip)

    def _spawn(self, argv: list[str], env: dict[str, str], ip: str) -> Standin:
        log = self.workdir / f"node-{len(self.started)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**_env_without_ray(), **env},
                cwd=REPO,
                start_new_session=True,
            )
        standin = Standin(proc, log, ip, self.api_port)
        self.started.append(standin)
        return standin

    def store_connections(self) -> int:
        return store_connections(self.master_port)

    def stop_all(self) -> None:
        for standin in self.started:
            stop(standin.proc, grace=5)


def store_connections(port: int) -> int:
    """The leader's established connections on the master port, as `ss` shows them: one per
    rank, the leader's own included. Their peers say nothing of the ranks' nodes: on loopback
    every rank connects from 127.0.0.1, as the real vLLM's do."""
    argv = ["ss", "-Htn", "state", "established", f"( sport = :{port} )"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return len([line for line in out.splitlines() if line.strip()])


@pytest.fixture
def mp(tmp_path: Path) -> Iterator[MpCluster]:
    cluster = MpCluster(tmp_path)
    yield cluster
    cluster.stop_all()


def exits(standin: Standin, timeout: float = 20) -> tuple[int, str]:
    code = standin.wait_exit(timeout)
    return code, standin.output()


def workers(state: Path) -> list[tuple[str, int]]:
    return [(p.name, p.pid) for p in gpu_state.live_processes(state)]


# --------------------------------------------------------------------------- serving


def test_two_nodes_followers_first(mp: MpCluster) -> None:
    follower = mp.start(1)
    follower.wait_for("distributed_init_method=")
    leader = mp.start(0)
    leader.wait_serving()
    assert mp.store_connections() == 2
    answer = leader.chat(model=MODEL, max_tokens=50).json()["choices"][0]
    assert answer["finish_reason"] == "length"
    assert follower.refuses_connections() and follower.proc.poll() is None
    assert workers(mp.gpu(0)) == [("VLLM::Worker_TP0", leader.proc.pid)]
    assert workers(mp.gpu(1)) == [("VLLM::Worker_TP1", follower.proc.pid)]
    _assert_logs(leader, follower, mp.master_port)
    # The leader goes: the follower notices nothing, stays up and holds its GPU (the real
    # engine's vllm#32136); SIGTERM ends it quietly.
    before = follower.output()
    stop(leader.proc)
    time.sleep(3)
    assert follower.proc.poll() is None and follower.output() == before
    assert workers(mp.gpu(1)) == [("VLLM::Worker_TP1", follower.proc.pid)]
    follower.proc.terminate()
    code, _ = exits(follower)
    assert code == 0
    wait_until(lambda: not workers(mp.gpu(1)), 5, "the follower's GPU released")


def _assert_logs(leader: Standin, follower: Standin, port: int) -> None:
    lead, follow = leader.output(), follower.output()
    assert (
        f"DP group leader: node_rank=0, node_rank_within_dp=0, master_addr={NODE_IPS[0]}, "
        f"mq_connect_ip={NODE_IPS[0]} (local), world_size=2, local_world_size=1" in lead
    )
    init = f"distributed_init_method=tcp://{NODE_IPS[0]}:{port} backend=nccl"
    assert f"[parallel_state.py:1400] world_size=2 rank=0 local_rank=0 {init}" in lead
    assert f"(Worker pid={leader.proc.pid}) INFO" in lead
    assert (
        f"[serve.py:193] Launching vLLM (v0.19.0) headless multiproc executor, with head node "
        f"address {NODE_IPS[0]}:{port} for torch.distributed process group." in follow
    )
    assert f"world_size=2 rank=1 local_rank=0 {init}" in follow
    # Each node's NCCL lines in its own log, without Ray's prefixes; the bar only on the leader.
    assert "NCCL INFO comm 0x" in lead and "rank 0 nRanks 2 nNodes 2" in lead
    assert "rank 1 nRanks 2 nNodes 2" in follow and "rank 0 nRanks" not in follow
    assert "RayWorkerWrapper" not in lead + follow
    assert "100% Completed | 4/4" in lead and "Loading safetensors" not in follow
    assert "Starting vLLM server" not in follow and "APIServer" not in follow
    assert "(Worker_TP1 pid=" in follow and "Model loading took" in follow


def test_four_nodes_leader_first(mp: MpCluster) -> None:
    slow = {"VRD_LOAD_SECONDS": "3"}
    leader = mp.start(0, 4, env=slow)
    leader.wait_for("backend=nccl")
    time.sleep(0.5)
    assert leader.proc.poll() is None and "Loading safetensors" not in leader.output()
    followers = [mp.start(rank, 4, env=slow, short=rank == 2) for rank in (1, 2, 3)]
    leader.wait_for("Loading safetensors checkpoint shards:   0% Completed")
    assert mp.store_connections() == 4  # every rank's, while loading
    assert leader.refuses_connections()
    leader.wait_serving()
    assert mp.store_connections() == 4
    assert status(leader, "/health") == 200
    for rank, follower in enumerate(followers, start=1):
        log = follower.output()
        assert follower.proc.poll() is None, log
        assert f"world_size=4 rank={rank} local_rank=0" in log
        assert f"rank {rank} nRanks 4 nNodes 4" in log
        assert workers(mp.gpu(rank)) == [(f"VLLM::Worker_TP{rank}", follower.proc.pid)]
    assert "world_size=4, local_world_size=1" in leader.output()


def test_follower_lost_while_serving_fails_the_next_step(mp: MpCluster) -> None:
    follower = mp.start(1)
    leader = mp.start(0, env={"VRD_DEAD_EXIT_DELAY": "1"})
    leader.wait_serving()
    os.killpg(follower.proc.pid, signal.SIGKILL)
    follower.wait_exit(5)
    time.sleep(0.5)
    assert status(leader, "/health") == 200  # vLLM's engine core is alive: it does not know yet
    assert leader.chat(max_tokens=5).status_code == 500
    assert status(leader, "/health") in (503, None)
    code, log = exits(leader)
    assert code == 0  # as the real leader: the engine died, the API server stopped "cleanly"
    assert "RuntimeError: NCCL error: remote process exited or there was a network error" in log
    assert "EngineCore encountered a fatal error." in log
    assert "EngineDeadError: EngineCore encountered an issue." in log


# --------------------------------------------------------------------------- failures


def test_a_firewall_open_only_on_the_master_port_hangs_both_nodes_silently(
    mp: MpCluster,
) -> None:
    """As the real engine (0.32.0) did on the bed: the rendezvous passes, then the ranks' own
    connections (ports the kernel picks) are dropped and both nodes wait, up and silent."""
    rule = ["OUTPUT", "-p", "tcp", "-d", NODE_IPS[0], "--dport", "32768:60999",
            "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"]  # fmt: skip
    subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        follower = mp.start(1)
        leader = mp.start(0)
        follower.wait_for("distributed_init_method=")
        leader.wait_for("distributed_init_method=")
        wait_until(lambda: mp.store_connections() == 2, 10, "both ranks at the rendezvous")
        quiet = (leader.output(), follower.output())
        time.sleep(5)
        assert (leader.output(), follower.output()) == quiet  # nothing more is said
        assert leader.proc.poll() is None and follower.proc.poll() is None
        assert leader.refuses_connections()
    finally:
        subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)
    # Nothing else held them back: with the ports open they go on and serve.
    leader.wait_serving()


def test_unreachable_master_times_out_on_both_sides(mp: MpCluster) -> None:
    follower = mp.start(1, master_addr=NOBODY)
    leader = mp.start(0)
    code, log = exits(follower)
    assert code == 1, log
    assert (
        f"torch.distributed.DistNetworkError: The client socket has timed out after "
        f"{RENDEZVOUS_S * 1000}ms while trying to connect to ({NOBODY}, {mp.master_port})."
    ) in log
    assert "WorkerProc failed to start." in log and log.rstrip().endswith(WORKERPROC)
    code, log = exits(leader)
    assert code == 1, log
    assert (
        f"torch.distributed.DistStoreError: Timed out after {RENDEZVOUS_S + 1} seconds waiting "
        "for clients. 1/2 clients joined."
    ) in log
    assert f"(EngineCore_DP0 pid={leader.proc.pid}) ERROR" in log
    assert "EngineCore failed to start." in log and WORKERPROC in log
    assert ENGINE_FAILED in log
    assert "Loading safetensors" not in log and "Starting vLLM server" not in log
    assert not workers(mp.gpu(0)) and not workers(mp.gpu(1))


def test_without_master_addr_a_follower_dials_its_own_loopback(mp: MpCluster) -> None:
    follower = mp.start(1, master_addr=None, env={"VRD_RENDEZVOUS_TIMEOUT": "1"})
    code, log = exits(follower)
    assert code == 1
    assert (
        "The client socket has timed out after 1000ms while trying to connect to "
        f"(127.0.0.1, {mp.master_port})."
    ) in log
    assert "head node address 127.0.0.1:" in log


def test_follower_killed_during_the_load_fails_the_leader(mp: MpCluster) -> None:
    follower = mp.start(1)
    leader = mp.start(0, env={"VRD_LOAD_SECONDS": "4"})
    leader.wait_for("Loading safetensors checkpoint shards:   0% Completed")
    os.killpg(follower.proc.pid, signal.SIGKILL)
    code, log = exits(leader)
    assert code == 1, log
    assert "[multiproc_executor.py:949] WorkerProc hit an exception." in log
    assert "RuntimeError: NCCL error: remote process exited or there was a network error" in log
    assert (
        "RuntimeError: Worker failed with error 'NCCL error: remote process exited or there was "
        "a network error', please check the stack trace above for the root cause"
    ) in log
    assert ENGINE_FAILED in log and STARTED not in log


def test_master_port_taken_fails_the_leader(mp: MpCluster) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", mp.master_port))
        taken.listen()
        code, log = exits(mp.start(0))
    assert code == 1
    assert (
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
        f"network address. port: {mp.master_port}, useIpv6: false, code: -98, name: EADDRINUSE, "
        "message: address already in use"
    ) in log
    assert ENGINE_FAILED in log


def test_headless_rank_zero_takes_the_data_parallel_branch(mp: MpCluster) -> None:
    standin = mp.start(0, 2, "--headless", env={"VRD_HANDSHAKE_TIMEOUT": "1"})
    code, log = exits(standin)
    assert code == 0  # vLLM waits for the engine process to end, then returns
    assert (
        "Launching 1 data parallel engine(s) in headless mode, with head node address "
        "tcp://127.0.0.1:29550." in log
    )
    assert "RuntimeError: Did not receive response from front-end process within 5 minutes" in log
    assert "world_size=" not in log and "Starting vLLM server" not in log


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["-tp", "3", "--nnodes", "2"],
         "AssertionError: world_size=3 must be divisible by nnodes=2."),
        (["-tp", "2", "-n", "2", "-r", "2", "--headless"],
         "AssertionError: node_rank=2 must be less than nnodes=2."),
        (["-tp", "2", "--nnodes", "2", "--distributed-executor-backend", "ray"],
         "  Value error, nnodes > 1 can only be set when distributed executor backend is mp, uni "
         "or external_launcher. [type=value_error,"),
        (["-tp", "2", "-n", "2", "-r", "1", "--headless", "--api-server-count", "1"],
         "ValueError: --api-server-count=1 cannot be used with --headless (no API servers are "
         "started in headless mode)."),
    ],
    ids=["world-size", "node-rank", "ray-backend", "api-servers-headless"],
)  # fmt: skip
def test_rejected_flag_combinations(mp: MpCluster, flags: list[str], error: str) -> None:
    argv = [
        sys.executable, "-m", "tests.testbed.standins.vllm_standin", "serve", MODEL,
        "--host", NODE_IPS[0], "--port", str(mp.api_port), *flags,
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=30, env=_env_without_ray(), cwd=REPO
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert error in result.stderr
    assert result.stderr.splitlines()[0].endswith("Traceback (most recent call last):")
    assert "world_size=" not in result.stdout


# --------------------------------------------------------------------------- the image without Ray


@pytest.fixture(scope="module")
def mp_bed() -> Iterator[TestBed]:
    testbed = make_bed(2, "h200", first_ip=191)
    yield testbed
    testbed.down()


def test_the_image_without_ray_serves_across_nodes(mp_bed: TestBed) -> None:
    bed = mp_bed
    settings = bed.settings()["vllm"]
    port = settings["master_port"]
    api = free_port(bed.nodes[0].ip)
    names = []
    try:
        for rank in (1, 0):  # a follower before its leader: it waits for the store
            names.append(_run_node(bed, rank, port, api))
        url = f"http://{bed.nodes[0].ip}:{api}/v1/models"
        assert _answers(url, 60), _logs(bed, names)
        follower_log, leader_log = _logs(bed, names)
        assert "headless multiproc executor" in follower_log
        assert "rank 1 nRanks 2 nNodes 2" in follower_log
        assert "rank 0 nRanks 2 nNodes 2" in leader_log and STARTED in leader_log
        assert store_connections(port) == 2
        for rank, node in enumerate(bed.nodes):
            assert workers(node.gpu_dir)[0][0] == f"VLLM::Worker_TP{rank}"
        assert "RayWorkerWrapper" not in leader_log + follower_log
    finally:
        for node, name in zip((bed.nodes[1], bed.nodes[0]), names, strict=False):
            with contextlib.closing(node.engine.client()) as client:
                client.containers.get(name).remove(force=True)


def _run_node(bed: TestBed, rank: int, port: int, api: int) -> str:
    node = bed.nodes[rank]
    settings = bed.settings()["vllm"]
    command = [
        str(bed.model_dir), "--host", node.ip, "--port", str(api), "-tp", "2",
        "--nnodes", "2", "--node-rank", str(rank), "--master-addr", bed.nodes[0].ip,
        "--master-port", str(port), *(["--headless"] if rank else []),
    ]  # fmt: skip
    env = {
        **settings["env"],
        "VLLM_HOST_IP": node.ip,
        "VRD_LOAD_SECONDS": "1",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
    }
    name = f"mp-{rank}-{os.getpid()}"
    with contextlib.closing(node.engine.client()) as client:
        client.containers.run(
            image.NO_RAY_IMAGE,
            command,
            name=name,
            environment=env,
            volumes=[*settings["volumes"], bed.model_mount],
            network_mode="host",
            detach=True,
        )
    return name


def _logs(bed: TestBed, names: list[str]) -> list[str]:
    logs = []
    for node, name in zip((bed.nodes[1], bed.nodes[0]), names, strict=False):
        with contextlib.closing(node.engine.client()) as client:
            logs.append(client.containers.get(name).logs().decode())
    return logs


def _answers(url: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        time.sleep(0.3)
    return False
