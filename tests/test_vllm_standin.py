"""The vLLM stand-in, run as a real process against a real two-node Ray cluster (no mocks).

The cluster mirrors the two DGX Sparks: a head on 127.0.0.21 and a worker on 127.0.0.22 with one
GPU each, so TP=2 must span both nodes. Each node has its own emulated GPU state directory
(``VRD_GPU_STATE`` in that node's ``ray start`` environment, inherited by its Ray workers).

The cluster is started once per module with ``ray start --block`` in sessions of its own and is
stopped by signalling exactly those processes: ``ray stop`` would stop every Ray on the machine.
Tests that need no Ray (flags, faults, answer shapes) run the stand-in with TP=1 and no Ray.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.testbed import hf_cache
from tests.testbed.bed import bed_ip
from tests.testbed.procs import free_port, spawn, stop, wait_until
from tests.testbed.standins import gpu_state

pytestmark = pytest.mark.integration

HEAD_IP = bed_ip(21)
WORKER_IP = bed_ip(22)
MODEL = "Qwen/Qwen3.5-122B-A10B-FP8"
SERVED = "qwen35"
RAY = str(Path(sys.executable).with_name("ray"))
ROOT_MARK = "VRD_TEST_RAY_ROOT"  # set on our `ray start`s; their daemons and workers inherit it
HELLO = [{"role": "user", "content": "Say hello in one sentence."}]


# --------------------------------------------------------------------------- Ray cluster


@dataclass
class RayNode:
    ip: str
    gpu_state: Path
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Cluster:
    address: str
    head: RayNode
    worker: RayNode
    root: Path


def _start_ray_node(root: Path, name: str, ip: str, role: list[str]) -> RayNode:
    state = root / f"gpu-{name}"
    gpu_state.write_config(state, profile="gb10", gpus=1)
    argv = [
        RAY, "start", "--block", f"--node-ip-address={ip}", "--num-gpus=1",
        "--disable-usage-stats", f"--temp-dir={root / name}", "--object-store-memory=100000000",
        f"--dashboard-agent-listen-port={free_port(ip)}", *role,
    ]  # fmt: skip
    env = {
        gpu_state.ENV_STATE: str(state),
        ROOT_MARK: f"{root}:{name}",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Notice a dead node in ~3 s instead of Ray's ~15 s, to keep the module fast.
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }
    log = root / f"{name}.log"
    node = RayNode(ip, state, spawn(argv, log, env={**_env_without_ray(), **env}), log)
    wait_until(lambda: _node_started(node), 60, f"ray {name} on {ip}", log)
    return node


def _head_role(gcs_port: int) -> list[str]:
    return [
        "--head", f"--port={gcs_port}", "--num-cpus=2", "--include-dashboard=false",
        f"--dashboard-port={free_port(HEAD_IP)}",
    ]  # fmt: skip


def _node_started(node: RayNode) -> bool:
    log = node.log.read_text(errors="replace")
    assert node.proc.poll() is None, f"ray start on {node.ip} exited:\n{log[-2000:]}"
    return "Ray runtime started." in log


@functools.cache
def model_cache() -> Path:
    """A Hugging Face cache holding MODEL (its config.json), for the stand-ins these tests start
    by repo id: vLLM offline finds nothing else."""
    hub = Path(tempfile.mkdtemp(prefix="vrd-hub-"))
    atexit.register(shutil.rmtree, hub, True)
    hf_cache.write_snapshot(
        hub, MODEL, {"config.json": b'{"architectures": ["Qwen3_5MoeForCausalLM"]}'}
    )
    return hub


def _env_without_ray() -> dict[str, str]:
    drop = ("RAY_ADDRESS", "VLLM_HOST_IP", gpu_state.ENV_STATE)
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("VRD_")}
    return {**env, "HF_HUB_CACHE": str(model_cache()), "HF_HUB_OFFLINE": "1"}


def _stop_ray_node(node: RayNode) -> None:
    stop(node.proc, grace=20)  # SIGTERM: `ray start --block` stops its node's daemons


def _kill_marked(mark: str) -> None:
    """Every process whose mark starts with ``mark``: a node's daemons and its Ray workers."""
    prefix = f"{ROOT_MARK}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = (proc / "environ").read_bytes().split(b"\0")
            if any(item.startswith(prefix) for item in env):
                os.kill(int(proc.name), signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="vrdray-", dir="/tmp"))  # short: Ray's socket paths
    nodes: list[RayNode] = []
    gcs_port = free_port(HEAD_IP)
    address = f"{HEAD_IP}:{gcs_port}"
    try:
        nodes.append(_start_ray_node(root, "head", HEAD_IP, _head_role(gcs_port)))
        nodes.append(
            _start_ray_node(root, "worker", WORKER_IP, [f"--address={address}", "--num-cpus=1"])
        )
        yield Cluster(address, nodes[0], nodes[1], root)
    finally:
        for node in reversed(nodes):
            _stop_ray_node(node)
        _kill_marked(str(root))
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- the stand-in


@dataclass
class Standin:
    proc: subprocess.Popen[bytes]
    log: Path
    host: str
    port: int

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 30) -> None:
        def seen() -> bool:
            if text in self.output():
                return True
            assert self.proc.poll() is None, f"stand-in exited {self.proc.returncode}"
            return False

        wait_until(seen, timeout, f"{text!r} in the stand-in log", self.log)

    def wait_serving(self, timeout: float = 30) -> None:
        self.wait_for("Application startup complete.", timeout)

    def refuses_connections(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base + path, timeout=10)

    def chat(self, timeout: float = 10, **body: Any) -> httpx.Response:
        body.setdefault("messages", HELLO)
        return httpx.post(self.base + "/v1/chat/completions", json=body, timeout=timeout)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)


@dataclass
class Launcher:
    """Starts stand-ins on the head's address and always stops them at teardown."""

    workdir: Path
    started: list[Standin] = field(default_factory=list)

    def start(self, *flags: str, env: dict[str, str] | None = None, tp: int = 1) -> Standin:
        port = free_port(HEAD_IP)
        argv = [
            sys.executable, "-m", "tests.testbed.standins.vllm_standin", "serve", MODEL,
            "--host", HEAD_IP, "--port", str(port), "--tensor-parallel-size", str(tp), *flags,
        ]  # fmt: skip
        log = self.workdir / f"vllm-{len(self.started)}.log"
        base = {"VRD_LOAD_SECONDS": "0.3", "VRD_PG_LOG_INTERVAL": "1", "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**_env_without_ray(), **base, **(env or {})},
                cwd=Path(__file__).parent.parent,
                start_new_session=True,
            )
        standin = Standin(proc, log, HEAD_IP, port)
        self.started.append(standin)
        return standin

    def serve(self, *flags: str, env: dict[str, str] | None = None, tp: int = 1) -> Standin:
        standin = self.start(*flags, env=env, tp=tp)
        standin.wait_serving()
        return standin

    def stop_all(self) -> None:
        for standin in self.started:
            stop(standin.proc, grace=5)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launch = Launcher(tmp_path)
    yield launch
    launch.stop_all()


def ray_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    return {"RAY_ADDRESS": cluster.address, "VLLM_HOST_IP": HEAD_IP, **extra}


def ray_flags() -> tuple[str, ...]:
    return ("--distributed-executor-backend", "ray", "--reasoning-parser", "qwen3",
            "--served-model-name", SERVED)  # fmt: skip


def status(standin: Standin, path: str) -> int | None:
    """HTTP status, or None while nothing listens."""
    try:
        return standin.get(path).status_code
    except httpx.TransportError:
        return None


def live(state: Path) -> list[gpu_state.GpuProcess]:
    return gpu_state.live_processes(state)


def message(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


# --------------------------------------------------------------------------- TP=2 on two nodes


@dataclass
class Served:
    standin: Standin
    refused_while_loading: bool


def _wait_gpus_free(cluster: Cluster) -> None:
    """A previous server's ranks are gone (Ray frees them a moment after their driver)."""
    for node in (cluster.head, cluster.worker):
        wait_until(lambda n=node: not live(n.gpu_state), 20, f"GPU on {node.ip} free")


@pytest.fixture
def ray_launcher(cluster: Cluster, launcher: Launcher) -> Launcher:
    _wait_gpus_free(cluster)
    return launcher


@pytest.fixture(scope="class")
def served(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    _wait_gpus_free(cluster)
    launch = Launcher(tmp_path_factory.mktemp("tp2"))
    try:
        # The load counts from the process's start: leave time to load after joining Ray.
        standin = launch.start(*ray_flags(), tp=2, env=ray_env(cluster, VRD_LOAD_SECONDS="6"))
        standin.wait_for("Loading safetensors checkpoint shards:   0% Completed", 60)
        refused = standin.refuses_connections()
        standin.wait_serving()
        yield Served(standin, refused)
    finally:
        launch.stop_all()


class TestTwoNodeServer:
    """One TP=2 server across both nodes, shared by read-only checks.

    It holds both GPUs until the class is done; the Ray tests below it need them free.
    """

    def test_port_refuses_connections_until_loaded(self, served: Served) -> None:
        assert served.refused_while_loading
        log = served.standin.output()
        assert log.index("100% Completed | 4/4") < log.index("Application startup complete.")
        assert served.standin.get("/health").status_code == 200

    def test_logs_like_vllm_on_ray(self, served: Served) -> None:
        log = served.standin.output()
        assert "[utils.py:253] non-default args: {'model_tag': 'Qwen/Qwen3.5-122B-A10B-FP8'" in log
        assert "Tensor parallel size (2) exceeds available GPUs (1)." in log
        assert "No current placement group found. Creating a new placement group." in log
        assert log.count("tensor_parallel_size=2 is bigger than a reserved number of GPUs") == 2
        assert f"Starting vLLM server on http://{HEAD_IP}:{served.standin.port}" in log

    def test_models_lists_the_served_name(self, served: Served) -> None:
        listing = served.standin.get("/v1/models").json()
        assert listing["object"] == "list"
        [card] = listing["data"]
        assert (card["id"], card["root"], card["owned_by"]) == (SERVED, MODEL, "vllm")
        assert card["max_model_len"] == 262144 and card["parent"] is None

    def test_health_version_and_metrics(self, served: Served) -> None:
        health = served.standin.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert served.standin.get("/version").json() == {"version": "0.19.0"}
        assert "vllm:num_requests_running{" in served.standin.get("/metrics").text

    def test_budget_spent_thinking(self, served: Served) -> None:
        response = served.standin.chat(model=SERVED, max_tokens=50, temperature=0)
        body = response.json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] is None
        assert choice["message"]["reasoning"].startswith("Thinking Process:")
        assert body["usage"]["completion_tokens"] == 50
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")

    def test_large_budget_thinks_then_answers(self, served: Served) -> None:
        response = served.standin.chat(model=SERVED, max_tokens=1000)
        assert response.json()["choices"][0]["finish_reason"] == "stop"
        answer = message(response)
        assert answer["content"].startswith("Hello!")
        assert "**Final Polish:**" in answer["reasoning"]

    def test_thinking_switched_off(self, served: Served) -> None:
        response = served.standin.chat(
            model=SERVED, max_tokens=50, chat_template_kwargs={"enable_thinking": False}
        )
        answer = message(response)
        assert answer["content"].startswith("Hello!") and answer["reasoning"] is None
        assert response.json()["choices"][0]["finish_reason"] == "stop"

    def test_unknown_model_is_404(self, served: Served) -> None:
        response = served.standin.chat(model="gpt-4o")
        assert response.status_code == 404
        assert response.json() == {
            "error": {
                "message": "The model `gpt-4o` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }

    def test_bad_json_and_unknown_paths(self, served: Served) -> None:
        bad = httpx.post(served.standin.base + "/v1/chat/completions", content=b"{nope")
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "Bad Request"
        assert served.standin.get("/v2/nothing").status_code == 404

    def test_each_rank_holds_memory_on_its_own_node(self, served: Served, cluster: Cluster) -> None:
        want = int(0.9 * 143771)
        for node in (cluster.head, cluster.worker):
            [rank] = live(node.gpu_state)
            assert (rank.name, rank.used_mib) == ("ray::RayWorkerWrapper", want)
            assert rank.pid != served.standin.proc.pid


# --------------------------------------------------------------------------- Ray failure modes


def _answers_200_until_a_request_finds_the_rank_gone(standin: Standin, quiet_s: float) -> None:
    """vLLM's Ray executor does not watch its ranks once serving: /health and /v1/models stay 200
    (the stand-in used to turn 503 within a second); the next request fails with HTTP 500 and
    the server exits 1."""
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        assert status(standin, "/health") == 200 and status(standin, "/v1/models") == 200
        time.sleep(0.5)
    answer = standin.chat(timeout=180, model=SERVED, max_tokens=5)
    assert answer.status_code == 500, answer.text
    assert standin.wait_exit(20) == 1


def test_dead_rank_keeps_health_200_until_a_request_fails(
    cluster: Cluster, ray_launcher: Launcher
) -> None:
    standin = ray_launcher.serve(*ray_flags(), tp=2, env=ray_env(cluster, VRD_DEAD_EXIT_DELAY="2"))
    [worker_rank] = live(cluster.worker.gpu_state)
    os.kill(worker_rank.pid, signal.SIGKILL)  # an OOM kill inside a live container
    _answers_200_until_a_request_finds_the_rank_gone(standin, quiet_s=5)
    assert "ray.exceptions.ActorDiedError: The actor died" in standin.output()
    wait_until(lambda: not live(cluster.head.gpu_state), 15, "head rank released")


def test_a_rank_that_dies_during_the_load_fails_the_engine_at_once(
    cluster: Cluster, ray_launcher: Launcher
) -> None:
    env = ray_env(cluster, VRD_DEAD_EXIT_DELAY="1", VRD_LOAD_SECONDS="60")
    standin = ray_launcher.start(*ray_flags(), tp=2, env=env)
    # The rank holds its GPU before NCCL's init; killed then, the head's init fails instead.
    wait_until(lambda: "Starting to load model" in standin.output(), 60, "the load's start")
    [worker_rank] = live(cluster.worker.gpu_state)
    os.kill(worker_rank.pid, signal.SIGKILL)
    assert standin.wait_exit(20) == 1
    assert "ray.exceptions.ActorDiedError: The actor died" in standin.output()
    assert standin.refuses_connections() or standin.proc.poll() is not None


def test_killed_standin_releases_every_rank(cluster: Cluster, ray_launcher: Launcher) -> None:
    standin = ray_launcher.serve(*ray_flags(), tp=2, env=ray_env(cluster))
    assert live(cluster.head.gpu_state) and live(cluster.worker.gpu_state)
    os.killpg(standin.proc.pid, signal.SIGKILL)
    standin.wait_exit(5)
    for node in (cluster.head, cluster.worker):
        wait_until(lambda n=node: not live(n.gpu_state), 15, f"ranks on {node.ip} released")


def test_dead_worker_node_keeps_health_200_until_a_request_fails(
    cluster: Cluster, ray_launcher: Launcher
) -> None:
    standin = ray_launcher.serve(*ray_flags(), tp=2, env=ray_env(cluster, VRD_DEAD_EXIT_DELAY="1"))
    _kill_marked(f"{cluster.root}:worker")  # the worker node's container dies, ranks and all
    try:
        _answers_200_until_a_request_finds_the_rank_gone(standin, quiet_s=3)
        log = standin.output()
        assert "ray.exceptions.ActorDiedError: The actor died" in log
        # Ray names the node's death, or the rank's process's when that process's lost connection
        # reaches the caller before the GCS declares the node dead (the order varies under load).
        assert (
            "The actor died because its node has died." in log
            or "The actor is dead because its worker process has died." in log
        ), log
    finally:
        cluster.worker.proc.wait(10)
        cluster.worker = _start_ray_node(
            cluster.root, "worker", WORKER_IP, [f"--address={cluster.address}", "--num-cpus=1"]
        )


def _assert_waits_for_placement(standin: Standin, specs: str) -> None:
    standin.wait_for("Waiting for creating a placement group of specs for", 30)
    log = standin.output()
    assert f"specs={specs}. Check `ray status` and `ray list nodes`" in log
    assert "same as VLLM_HOST_IP environment variable specified in each node" in log
    assert standin.proc.poll() is None and standin.refuses_connections()


def test_tp_larger_than_cluster_waits_for_placement(
    cluster: Cluster, ray_launcher: Launcher
) -> None:
    standin = ray_launcher.start(*ray_flags(), tp=4, env=ray_env(cluster))
    specs = (
        f"[{{'GPU': 1.0, 'node:{HEAD_IP}': 0.001}}, {{'GPU': 1.0}}, {{'GPU': 1.0}}, {{'GPU': 1.0}}]"
    )
    _assert_waits_for_placement(standin, specs)
    log = standin.output()
    assert "Tensor parallel size (4) exceeds available GPUs (1)." in log
    assert "The number of required GPUs exceeds the total number of available GPUs" in log


def test_vllm_host_ip_mismatch_waits_for_placement(
    cluster: Cluster, ray_launcher: Launcher
) -> None:
    env = ray_env(cluster) | {"VLLM_HOST_IP": "192.168.200.12"}
    standin = ray_launcher.start(*ray_flags(), tp=2, env=env)
    _assert_waits_for_placement(
        standin, "[{'GPU': 1.0, 'node:192.168.200.12': 0.001}, {'GPU': 1.0}]"
    )


# --------------------------------------------------------------------------- CLI


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tests.testbed.standins.vllm_standin", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=30, env={**_env_without_ray(), **(env or {})}
    )


def test_version_is_configurable() -> None:
    assert _run_cli("--version").stdout.strip() == "0.19.0"
    assert _run_cli("--version", env={"VRD_VLLM_VERSION": "0.11.2"}).stdout.strip() == "0.11.2"


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--bogus-flag"], "vllm: error: unrecognized arguments: --bogus-flag"),
        (["--enable-reasoning", "--reasoning-parser", "qwen3"],
         "vllm: error: unrecognized arguments: --enable-reasoning"),
        (["-tp", "2", "--distributed-executor-backend", "slurm"],
         "argument --distributed-executor-backend: invalid choice: 'slurm'"),
    ],
    ids=["unknown-flag", "enable-reasoning", "bad-backend"],
)  # fmt: skip
def test_rejected_flags_exit_2(flags: list[str], error: str) -> None:
    result = _run_cli("serve", MODEL, *flags)
    assert result.returncode == 2
    assert error in result.stderr


def test_underscore_flags_and_served_names(launcher: Launcher) -> None:
    standin = launcher.serve("--max_model_len", "32k", "--served-model-name", "a", "b")
    cards = standin.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [
        ("a", MODEL, 32000),
        ("b", MODEL, 32000),
    ]
    assert standin.chat().json()["model"] == "a"
    assert status(standin, "/v1/chat/completions") == 405


# --------------------------------------------------------------------------- answers without Ray


@pytest.mark.parametrize("mode", ["reasoning", "reasoning_content", "both"])
def test_reasoning_field_modes(launcher: Launcher, mode: str) -> None:
    standin = launcher.serve("--reasoning-parser", "qwen3", env={"VRD_REASONING_FIELD": mode})
    answer = message(standin.chat(model=MODEL, max_tokens=50))
    names = {"reasoning", "reasoning_content"} & answer.keys()
    assert names == ({"reasoning", "reasoning_content"} if mode == "both" else {mode})
    assert all(answer[name].startswith("Thinking Process:") for name in names)


def test_streaming_sends_reasoning_then_content(launcher: Launcher) -> None:
    standin = launcher.serve("--reasoning-parser", "qwen3")
    events = standin.chat(stream=True, max_tokens=1000).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e and "[DONE]" not in e]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [next(iter(d), None) for d in deltas] == ["role", "reasoning", "content", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and events[-2] == "data: [DONE]"


def test_without_parser_content_carries_think_tags(launcher: Launcher) -> None:
    standin = launcher.serve()
    short = message(standin.chat(max_tokens=50))
    assert short["content"].startswith("<think>\nThinking Process:")
    assert short["reasoning"] is None
    full = message(standin.chat())
    assert "\n</think>\n\nHello!" in full["content"]


def test_local_engine_holds_gpu_until_killed(launcher: Launcher, tmp_path: Path) -> None:
    gpu_state.write_config(tmp_path / "gpu")
    standin = launcher.serve(env={gpu_state.ENV_STATE: str(tmp_path / "gpu")})
    [engine] = live(tmp_path / "gpu")
    assert (engine.pid, engine.name) == (standin.proc.pid, "VLLM::EngineCore")
    standin.proc.kill()
    standin.wait_exit(5)
    assert not live(tmp_path / "gpu")


def test_refuses_to_start_when_gpu_memory_is_taken(launcher: Launcher, tmp_path: Path) -> None:
    state = tmp_path / "gpu"
    gpu_state.write_config(state)
    with gpu_state.register(state, "python3", 100_000):
        standin = launcher.start(env={gpu_state.ENV_STATE: str(state)})
        assert standin.wait_exit(20) == 1
    assert "ValueError: Free memory on device (42.75/140.4 GiB) on startup is less than" in (
        standin.output()
    )


# --------------------------------------------------------------------------- faults


def test_crash_during_load_is_sigkill_after_an_oom(launcher: Launcher) -> None:
    standin = launcher.start(env={"VRD_FAULT": "crash_during_load"})
    assert standin.wait_exit(20) == -signal.SIGKILL  # 137 in a shell or as a container
    log = standin.output()
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in log
    assert "50% Completed | 2/4" in log and "75% Completed" not in log


def test_exit_during_load_uses_the_given_code(launcher: Launcher) -> None:
    standin = launcher.start(env={"VRD_FAULT": "exit_during_load:3"})
    assert standin.wait_exit(20) == 3
    assert "EngineCore failed to start." in standin.output()


def test_hang_stops_at_half_and_never_serves(launcher: Launcher) -> None:
    standin = launcher.start(env={"VRD_FAULT": "hang"})
    standin.wait_for("50% Completed | 2/4")
    time.sleep(0.6)  # twice the whole load time
    assert standin.proc.poll() is None and standin.refuses_connections()
    assert "75% Completed" not in standin.output()


@pytest.mark.parametrize(("version", "gives_up"), [("0.32.0", False), ("0.33.0", True)])
def test_the_engine_ready_timeout_bounds_the_start_from_0_33(
    launcher: Launcher, version: str, gives_up: bool
) -> None:
    env = {"VRD_VLLM_VERSION": version, "VRD_LOAD_SECONDS": "3", "VLLM_ENGINE_READY_TIMEOUT_S": "1"}
    standin = launcher.start(env=env)
    if not gives_up:  # as the real 0.32.0 (tests/test_vllm_differential.py)
        standin.wait_serving()
        return
    assert standin.wait_exit(20) == 1
    assert (
        "TimeoutError: Timed out waiting for engine core processes to start. This is often caused "
        "by slow weight loading for large models. Waited 1s (configured by "
        "VLLM_ENGINE_READY_TIMEOUT_S)."
    ) in standin.output()
    assert standin.refuses_connections()


def test_wrong_name_and_health_503(launcher: Launcher) -> None:
    standin = launcher.serve(env={"VRD_FAULT": "wrong_name:glm-4.5-air,health_503"})
    assert [m["id"] for m in standin.get("/v1/models").json()["data"]] == ["glm-4.5-air"]
    assert standin.get("/health").status_code == 503
    assert standin.chat(model=MODEL).status_code == 404


def test_empty_and_slow_answer(launcher: Launcher) -> None:
    standin = launcher.serve("--reasoning-parser", "qwen3", env={"VRD_FAULT": "empty,slow:0.5"})
    started = time.monotonic()
    response = standin.chat(max_tokens=50)
    assert time.monotonic() - started >= 0.5
    answer = message(response)
    assert (answer["content"], answer["reasoning"]) == ("", "")
    assert response.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("fault", "status", "check"),
    [
        ("http_500", 500, lambda r: r.json()["error"]["code"] == 500),
        ("html_error", 502, lambda r: r.headers["content-type"] == "text/html"
         and "<h1>502 Bad Gateway</h1>" in r.text),
        ("malformed_json", 200, lambda r: not _parses(r.text)),
    ],
)  # fmt: skip
def test_broken_chat_answers(
    launcher: Launcher, fault: str, status: int, check: Callable[[httpx.Response], bool]
) -> None:
    standin = launcher.serve(env={"VRD_FAULT": fault})
    response = standin.chat()
    assert response.status_code == status
    assert check(response)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
