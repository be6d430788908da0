"""The fault matrix: one row per fault the flow must survive or report, on one 2-node bed.

Every row asserts the final flow state, the message (node, step and cause in plain words), how
long the failure took to detect and what was left running. A canary container (restart policy
unless-stopped) and a canary model directory on every node must survive every row. The rows are
written to tests/output/fault_matrix.md and printed at the end, for the team's notes.

Select them with ``-m slow``; leave them out with ``-m "not slow"``.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType

from flows.redeploy import redeploy_vllm_cluster
from tasks.context import Run
from tasks.fabric_reach import pick_port, reach_on
from tests.conftest import RAY, make_bed
from tests.testbed import image
from tests.testbed.bed import SERVED_NAME, TestBed, bed_ip
from tests.testbed.node import EmulatedNode
from tests.testbed.procs import descendants, free_port, wait_until
from vllm_redeploy import PROJECT
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.launch.group import engine_container
from vllm_redeploy.launch.ray import ray_container
from vllm_redeploy.nodes.containers import LABEL_CLUSTER, LABEL_MANAGED, LABEL_ROLE
from vllm_redeploy.probe import run_probe
from vllm_redeploy.summary import StepEvent, listening

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIRST_IP = 201  # this module's addresses: 127.0.0.201 (head) and .202 (worker)
HEAD, WORKER = "node-1", "node-2"
FAST = {"VRD_LOAD_SECONDS": "1"}
RESULTS = Path(__file__).resolve().parent / "output" / "fault_matrix.md"
CANARY = "canary"
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the bed


@dataclass
class Canaries:
    """What must survive every row: per node the canary container's ID, and file digests."""

    containers: dict[str, str]
    files: dict[Path, str]


def _digests(paths: list[Path]) -> dict[Path, str]:
    found = {}
    for root in paths:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                found[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def canary_dirs(bed: TestBed) -> list[Path]:
    """Per node a model directory we never configured, and the configured model directory."""
    return [*(n.root / "models" / "canary-model" for n in bed.nodes), bed.model_dir]


@pytest.fixture(scope="module")
def fault_bed(prefect_api: str) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=FIRST_IP)
    try:
        for node in bed.nodes:
            with contextlib.closing(node.engine.client()) as client:
                client.containers.run(
                    image.OLD_STACK_IMAGE,
                    ["sleep", "999999"],
                    name=CANARY,
                    detach=True,
                    network_mode="host",
                    restart_policy={"Name": "unless-stopped"},
                )
            model = node.root / "models" / "canary-model"
            model.mkdir(parents=True)
            (model / "config.json").write_text('{"architectures": ["CanaryForCausalLM"]}\n')
            (model / "model-00001-of-00001.safetensors").write_bytes(os.urandom(4096))
        (bed.model_dir / "model-00001-of-00002.safetensors").write_bytes(os.urandom(4096))
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="module")
def canaries(fault_bed: TestBed) -> Canaries:
    ids = {}
    for node in fault_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            ids[node.name] = client.containers.get(CANARY).id
    return Canaries(ids, _digests(canary_dirs(fault_bed)))


# --------------------------------------------------------------------------- the matrix


@dataclass
class Row:
    fault: str
    outcome: str = "(test did not finish)"
    detect: str = "-"
    survived: str = "-"
    left: str = "-"


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest) -> Iterator[list[Row]]:
    rows: list[Row] = []
    started = time.monotonic()
    yield rows
    took = time.monotonic() - started
    table = render(rows, took)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(table)
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n\n{table}")


def render(rows: list[Row], took: float) -> str:
    lines = [
        f"# Fault matrix ({len(rows)} rows, {took:.0f} s)",
        "",
        "| fault | outcome | time to detect | what survived / was left running |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [r.fault, r.outcome, r.detect, f"{r.survived}; left running: {r.left}"]
        lines.append(
            "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
        )
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def row(
    request: pytest.FixtureRequest, fault_bed: TestBed, canaries: Canaries, matrix: list[Row]
) -> Iterator[Row]:
    """The row this test fills in; after it, the canaries must have survived."""
    current = Row(request.node.name.removeprefix("test_"))
    matrix.append(current)
    yield current
    for node in fault_bed.nodes:  # a restarted engine brings the canary back by its policy
        wait_until(lambda n=node: canary_running(n, canaries), 30, f"{node.name}: canary")
    assert _digests(canary_dirs(fault_bed)) == canaries.files, "canary model files changed"
    current.survived = f"canary container (same ID) on {len(fault_bed.nodes)} nodes, model dirs"
    current.left = left_running(fault_bed)


def canary_running(node: EmulatedNode, canaries: Canaries) -> bool:
    with contextlib.closing(node.engine.client()) as client:
        container = client.containers.get(CANARY)
        return container.id == canaries.containers[node.name] and container.status == "running"


def ours(node: EmulatedNode, running_only: bool = True) -> list[tuple[str, str]]:
    """This project's containers on the node: (role, status)."""
    labels = [f"{LABEL_MANAGED}={PROJECT}", f"{LABEL_CLUSTER}=bed"]
    with contextlib.closing(node.engine.client()) as client:
        found = client.containers.list(all=not running_only, filters={"label": labels})
        return sorted((c.labels.get(LABEL_ROLE, "?"), c.status) for c in found)


def left_running(bed: TestBed) -> str:
    parts = []
    for node in bed.nodes:
        roles = [role for role, _ in ours(node)]
        if roles:
            parts.append(f"{node.name}: {'+'.join(roles)}")
    text = ", ".join(parts) or "none of ours"
    return text + (" (serving)" if served(bed) else "")


def served(bed: TestBed, timeout: float = 10) -> bool:
    url = f"http://{bed.nodes[0].ip}:30000"
    return run_probe(url, SERVED_NAME, "Say hello.", 50, 0.0, timeout).healthy


# --------------------------------------------------------------------------- running the flow


class StepClock:
    """The flow's step events in this process, timed; runs a hook when a step starts."""

    def __init__(self) -> None:
        self.events: list[tuple[float, StepEvent]] = []
        self._hooks: dict[str, Callable[[], None]] = {}
        self.threads: list[threading.Thread] = []

    def on_start(self, step: str, hook: Callable[[], None]) -> None:
        self._hooks[step] = hook

    def __call__(self, event: StepEvent) -> None:
        self.events.append((time.monotonic(), event))
        hook = self._hooks.pop(event.step, None) if event.state == "running" else None
        if hook is not None:
            thread = threading.Thread(target=hook, name=f"fault@{event.step}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def at(self, step: str, state: str) -> float:
        return next(t for t, e in self.events if e.step == step and e.state == state)

    def reached(self, step: str) -> bool:
        return any(e.step == step for _, e in self.events)

    def failed(self) -> tuple[float, StepEvent]:
        return next((t, e) for t, e in self.events if e.state == "failed")


@dataclass
class Outcome:
    state: Any
    clock: StepClock
    started: float
    ended: float

    @property
    def message(self) -> str:
        assert self.state.is_failed(), f"expected a failed run, got {self.state}"
        return str(self.state.result(raise_on_failure=False))

    @property
    def result(self) -> dict[str, Any]:
        assert self.state.is_completed(), self.message
        return self.state.result()

    @property
    def flow_run_id(self) -> Any:
        return self.state.state_details.flow_run_id

    def detected_after(self, since: float) -> float:
        """Seconds from ``since`` (monotonic) to the flow's failure report."""
        return self.clock.failed()[0] - since


def write_config(bed: TestBed, **changes: Any) -> Path:
    vllm = changes.pop("vllm", {})
    vllm["env"] = {**FAST, **vllm.get("env", {})}
    # A killed controller's hold on the cluster ends with its lease: Prefect's shortest.
    changes.setdefault("lock", {"lease_s": 60})
    return bed.write_config(bed.root / "run.toml", vllm=vllm, **changes)


def bed_config(bed: TestBed, **changes: Any) -> ClusterConfig:
    return load_config(write_config(bed, **changes), env_file=None)


def run_flow(
    bed: TestBed, mode: str = "redeploy", clock: StepClock | None = None, **changes: Any
) -> Outcome:
    path = write_config(bed, **changes)
    clock = clock or StepClock()
    started = time.monotonic()
    with listening(clock):
        state = redeploy_vllm_cluster(str(path), mode, return_state=True)  # type: ignore[arg-type]
    ended = time.monotonic()
    for thread in clock.threads:
        thread.join(60)
    if state.is_completed():
        steps = state.result()["steps"]
        print("steps: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    return Outcome(state, clock, started, ended)


def task_runs(flow_run_id: Any) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )


def running_flow_runs() -> list[Any]:
    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(state=running))


def remove_ours(bed: TestBed) -> None:
    """Nothing of ours runs (as after a reboot): the ports are free for a stranger."""
    labels = [f"{LABEL_MANAGED}={PROJECT}", f"{LABEL_CLUSTER}=bed"]
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for container in client.containers.list(all=True, filters={"label": labels}):
                container.remove(force=True)


def make_served(bed: TestBed, **changes: Any) -> None:
    """Precondition of some rows: the group runs and serves (ensure: a no-op when it does)."""
    outcome = run_flow(bed, "ensure", **changes)
    assert outcome.state.is_completed(), outcome.message
    assert served(bed)


def first_line(message: str) -> str:
    return message.splitlines()[0][:200]


def wait_for_command(node: EmulatedNode, fragment: str, timeout: float) -> int:
    """PID of a command run through this node's sshd whose command line has ``fragment``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(node.sshd.pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if fragment.encode() in f.read():
                    return pid
        time.sleep(0.01)
    raise TimeoutError(f"no {fragment!r} ran on {node.name} within {timeout:g} s")


class StaleServer:
    """A stranger's OpenAI-compatible server on the head's API port, serving another model."""

    def __init__(self, host: str, port: int, model: str) -> None:
        body = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = body.encode() if self.path == "/v1/models" else b"{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StaleServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- the rows


@pytest.mark.timeout(180)
def test_worker_unreachable_at_start_and_back_after_20s(fault_bed: TestBed, row: Row) -> None:
    row.fault = "worker unreachable at start (sshd down), back after 20 s"
    worker = fault_bed.node(WORKER)
    worker.stop_sshd()
    down = time.monotonic()
    back: list[float] = []

    def bring_back() -> None:
        time.sleep(20)
        worker.start_sshd()
        back.append(time.monotonic())

    thread = threading.Thread(target=bring_back, daemon=True)
    thread.start()
    try:
        outcome = run_flow(fault_bed, deadlines={"nodes_reachable_s": 45})
    finally:
        thread.join(30)
        if not worker.sshd.pid:
            worker.start_sshd()
    result = outcome.result
    assert result["action"] == "redeployed" and result["probe"]["healthy"]
    preflight_done = outcome.clock.at("preflight", "done")
    assert preflight_done - down >= 20  # it waited for the node instead of failing
    noticed = preflight_done - back[0]
    row.outcome = (
        f"Completed: preflight waited {preflight_done - down:.1f} s for {WORKER}, then served"
    )
    row.detect = f"back noticed {noticed:.1f} s after sshd returned"
    assert noticed < 30  # it polls every 2 s; far below the 45 s window it would wait out


def test_worker_never_back_fails_after_the_node_window(fault_bed: TestBed, row: Row) -> None:
    row.fault = "worker never back (sshd down for good)"
    worker = fault_bed.node(WORKER)
    worker.stop_sshd()
    down = time.monotonic()
    try:
        outcome = run_flow(fault_bed, deadlines={"nodes_reachable_s": 6})
    finally:
        worker.start_sshd()
    message = outcome.message
    assert message.startswith("preflight: ")
    assert f"node {WORKER} did not come back within 6 s" in message
    assert "connection refused" in message and "Is the node up and sshd running" in message
    took = outcome.detected_after(down)
    assert 6 <= took < 60  # after the window, and not waiting for anything else
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{took:.1f} s (window 6 s)"


def test_ssh_connection_cut_mid_step_is_retried(fault_bed: TestBed, row: Row) -> None:
    row.fault = (
        f"SSH session killed on the node mid-step: gpus-clear on {WORKER}, then wait-ready "
        f"on {HEAD}"
    )
    worker, head = fault_bed.node(WORKER), fault_bed.node(HEAD)
    clock = StepClock()
    cuts: dict[str, float] = {}
    # A GPU held for a moment keeps gpus-clear polling nvidia-smi, and each call takes a second
    # (a busy driver): the cut lands while one runs, not between two.
    holder = worker.hold_gpu(1024, "python3")

    def cut_during_gpus_clear() -> None:
        worker.nvidia_smi_answers_in(1.0)
        try:
            wait_for_command(worker, "nvidia_smi.py", 15)
            cuts["gpus-clear"] = time.monotonic()
            assert worker.sshd.drop_connections() >= 1
        finally:
            worker.nvidia_smi_answers_in(0)
            holder.kill()
            holder.wait()

    def cut_during_wait_ready() -> None:
        time.sleep(0.5)  # the engine starts and loads; wait-ready polls the head's Docker
        cuts["wait-ready"] = time.monotonic()
        assert head.sshd.drop_connections() >= 1

    clock.on_start("gpus-clear", cut_during_gpus_clear)
    clock.on_start("wait-ready", cut_during_wait_ready)
    try:
        outcome = run_flow(fault_bed, clock=clock, deadlines={"gpu_release_s": 20})
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert set(cuts) == {"gpus-clear", "wait-ready"}, f"cut only during {cuts}"
    assert outcome.result["probe"]["healthy"]
    runs = {t.name: t.run_count for t in task_runs(outcome.flow_run_id)}
    assert runs[f"gpus-clear[{WORKER}]"] == 2, runs  # the step was retried
    assert next(n for n in runs if n.startswith("wait-ready"))  # one run: it reconnected
    took = {step: outcome.clock.at(step, "done") - cut for step, cut in cuts.items()}
    assert all(t > 0 for t in took.values()), f"a cut came after its step ended: {took}"
    row.outcome = (
        f"Completed: gpus-clear[{WORKER}] failed with the connection and was retried (2 runs); "
        "wait-ready reconnected and kept waiting"
    )
    row.detect = (
        f"gpus-clear done {took['gpus-clear']:.1f} s after its cut (retry delay 2 s); "
        f"wait-ready went on, served {took['wait-ready']:.1f} s after its cut"
    )


def test_worker_dies_after_the_model_was_served(fault_bed: TestBed, row: Row) -> None:
    row.fault = "worker's Ray container dies after the model was served; then `ensure`"
    make_served(fault_bed, vllm=RAY)
    with contextlib.closing(fault_bed.node(WORKER).engine.client()) as client:
        client.containers.get(ray_container(bed_config(fault_bed, vllm=RAY))).kill()
    died = time.monotonic()
    outcome = run_flow(fault_bed, "ensure", vllm=RAY)
    result = outcome.result
    assert result["action"] == "redeployed"
    [note] = [n for n in result["notes"] if n.startswith("redeploying: ")]
    assert note.startswith(f"redeploying: the Ray container on {WORKER} is not running"), note
    # The engine on the head did not notice (vLLM's Ray executor assumes its ranks are
    # healthy): /health stayed 200 until ensure's generation got HTTP 500.
    assert "a 1-token generation failed: HTTP 500" in note, note
    assert served(fault_bed)
    took = outcome.clock.at("inspect", "done") - died
    row.outcome = (
        f"Completed: ensure saw 'the Ray container on {WORKER} is not running', redeployed "
        "the group, served"
    )
    row.detect = f"{took:.1f} s after the kill (ensure's inspect)"


@pytest.mark.timeout(180)
def test_docker_engine_restarted_during_load(fault_bed: TestBed, row: Row) -> None:
    row.fault = f"Docker engine on {WORKER} restarted during the load"
    worker = fault_bed.node(WORKER)
    clock = StepClock()
    restarted: list[float] = []

    def restart() -> None:
        time.sleep(1)
        restarted.append(time.monotonic())
        worker.restart_docker()

    clock.on_start("wait-ready", restart)
    outcome = run_flow(fault_bed, clock=clock, vllm={**RAY, "env": {"VRD_LOAD_SECONDS": "90"}})
    message = outcome.message
    assert message.startswith(f"wait-ready: the Ray container on {WORKER} exited with code")
    assert "Docker engine may have restarted" in message
    took = outcome.detected_after(restarted[0])
    assert took < 75  # long before the load (90 s) would have ended
    assert ours(fault_bed.node(HEAD), running_only=False) == []  # the group was torn down
    # On the worker nothing of ours runs; its exited Ray container stays when its Docker was
    # still restarting at teardown (the next run removes it by label).
    assert ours(worker) == []
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{took:.1f} s after the restart began"


def test_stray_process_holding_a_gpu(fault_bed: TestBed, row: Row) -> None:
    row.fault = f"stray process holding the GPU on {WORKER}"
    holder = fault_bed.node(WORKER).hold_gpu(20998, "python3")
    try:
        outcome = run_flow(fault_bed, deadlines={"gpu_release_s": 3})
    finally:
        holder.kill()
        holder.wait()
    message = outcome.message
    assert message.startswith("gpus-clear: ")
    assert f"GPU on {WORKER} still busy after 3 s" in message
    assert f"PID {holder.pid} (python3) holds 20998 MiB" in message
    took = outcome.detected_after(outcome.clock.at("gpus-clear", "running"))
    assert 3 <= took < 60  # the grace period, not the 120 s load deadline
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{took:.1f} s after gpus-clear began (grace 3 s)"


def test_a_gpu_whose_inforom_is_corrupted_still_serves_and_says_so(
    fault_bed: TestBed, row: Row
) -> None:
    """nvidia-smi warns "infoROM is corrupted" and exits 14 while the GPU works (vLLM runs on
    it): tolerated where nvidia-smi itself answers, and noted in the summary."""
    worker = fault_bed.node(WORKER)
    row.fault = f"nvidia-smi on {WORKER}: its answer, then 'infoROM is corrupted', exit 14"
    make_served(fault_bed)
    worker.nvidia_smi_faults(inforom_corrupted=(0,))
    try:
        outcome = run_flow(fault_bed)
    finally:
        worker.nvidia_smi_faults()
    summary = outcome.result["summary"]
    assert f"{WORKER}: nvidia-smi warns: WARNING: infoROM is corrupted at gpu " in summary
    assert served(fault_bed)
    row.outcome = "Completed, served; the summary notes the warning"
    row.detect = "preflight (a note)"


def test_an_nvidia_smi_line_that_is_not_a_row_is_refused_before_anything_stops(
    fault_bed: TestBed, row: Row
) -> None:
    worker = fault_bed.node(WORKER)
    row.fault = f"nvidia-smi on {WORKER} prints a line that is not one of its rows"
    make_served(fault_bed)
    before = {n.name: ours(n) for n in fault_bed.nodes}
    worker.nvidia_smi_faults(garbage="Unable to determine the device handle for GPU0: Unknown")
    try:
        outcome = run_flow(fault_bed)
    finally:
        worker.nvidia_smi_faults()
    message = outcome.message
    assert message.startswith("preflight: "), message
    assert f"{WORKER}: nvidia-smi's answer cannot be read (nvidia-smi line has 1 fields" in message
    assert "nothing was stopped" in message
    assert {n.name: ours(n) for n in fault_bed.nodes} == before  # the group untouched
    assert served(fault_bed)
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{outcome.ended - outcome.started:.1f} s after the start, before any change"


@pytest.mark.parametrize("which", ["api", "ray", "api-on-loopback"])
def test_stray_listener_on_a_port(fault_bed: TestBed, row: Row, which: str) -> None:
    """On the head's address; and, for an API bound to every address (vLLM's 0.0.0.0), an old
    server on 127.0.0.1, which that bind would collide with. The listener is this test's own
    process, outside every container and unit: preflight sees that stop-autostart would leave it
    and refuses before anything stops."""
    backend: dict[str, Any] = RAY if which == "ray" else {}
    if which == "api-on-loopback":
        # The product's default host; a port of this worker's own, since the bed's 127.0.0.1 is
        # the machine's, where the other worker's tests listen too.
        backend = {"host": "0.0.0.0", "port": free_port("127.0.0.1")}
    config = bed_config(fault_bed, vllm=backend)
    port = config.vllm.port if which != "ray" else config.ray.port
    label = "API port" if which != "ray" else "Ray port"
    address = "127.0.0.1" if which == "api-on-loopback" else fault_bed.node(HEAD).ip
    row.fault = f"stray listener on the {label} ({address}:{port}) of {HEAD}"
    remove_ours(fault_bed)
    fault_bed.node(HEAD).systemctl("stop", image.OLD_STACK_UNIT)  # it serves the API port
    with socket.socket() as stray:
        stray.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stray.bind((address, port))
        stray.listen()
        outcome = run_flow(fault_bed, deadlines={"gpu_release_s": 3}, vllm=backend)
    message = outcome.message
    assert message.startswith(f"preflight: {HEAD}: {address}:{port} (the {label}) is held by "), (
        message
    )
    assert f"(PID {os.getpid()})" in message  # the owner, as `ss -p` shows it
    assert "neither a container nor a unit that [autostart] names" in message
    assert "stop-autostart would leave it running" in message
    assert "nothing was stopped" in message
    assert not outcome.clock.reached("stop-autostart")  # nothing stopped
    took = outcome.ended - outcome.started
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{took:.1f} s after the start, before any change"


@pytest.mark.parametrize("units", ["a-unit-may-own-it", "no-unit"])
def test_a_container_not_named_holds_the_api_port(fault_bed: TestBed, row: Row, units: str) -> None:
    """A container that [autostart] does not name holds the API port. While a unit is stopped
    it may be that unit's `docker run`: preflight lets it pass and ports-free, after the stop,
    finds it still there. With no unit, nothing the run stops can free it: refused before."""
    head = fault_bed.node(HEAD)
    port = bed_config(fault_bed).vllm.port
    row.fault = f"a container not named in [autostart] on {HEAD}'s API port ({units})"
    remove_ours(fault_bed)
    head.systemctl("stop", image.OLD_STACK_UNIT)
    autostart = {"units": [image.OLD_STACK_UNIT] if units == "a-unit-may-own-it" else []}
    with contextlib.closing(head.engine.client()) as client:
        stranger = client.containers.run(
            image.OLD_STACK_IMAGE,
            ["busybox", "httpd", "-f", "-p", f"{head.ip}:{port}"],
            name="stranger-api",
            detach=True,
            network_mode="host",
        )
        try:
            head.wait_for_containers(["stranger-api"])
            outcome = run_flow(fault_bed, deadlines={"gpu_release_s": 3}, autostart=autostart)
        finally:
            stranger.remove(force=True)
    message = outcome.message
    if units == "no-unit":
        assert message.startswith(f"preflight: {HEAD}: {head.ip}:{port} (the API port) is held"), (
            message
        )
        assert "in container stranger-api, which [autostart] containers does not name" in message
        assert not outcome.clock.reached("stop-autostart")
        row.detect = f"{outcome.ended - outcome.started:.1f} s after the start, before any change"
    else:
        assert message.startswith("ports-free: "), message
        assert f"{HEAD}: the API port {port} is in use by a process that is not ours" in message
        took = outcome.detected_after(outcome.clock.at("ports-free", "running"))
        row.detect = f"{took:.1f} s after ports-free began (grace 3 s, after the old stack stopped)"
    row.outcome = f"Failed: {first_line(message)}"


@pytest.mark.parametrize("ip", ["not-assigned", "the-head's"])
def test_worker_fabric_ip_does_not_match(fault_bed: TestBed, row: Row, ip: str) -> None:
    address = "198.51.100.7" if ip == "not-assigned" else fault_bed.node(HEAD).ip
    row.fault = f"{WORKER} configured with a fabric IP it does not own ({ip}: {address})"
    before = {n.name: ours(n) for n in fault_bed.nodes}
    outcome = run_flow(fault_bed, nodes={WORKER: {"fabric_ip": address}})
    message = outcome.message
    if ip == "not-assigned":
        assert message.startswith("preflight: ")
        assert f"{WORKER}: the fabric IP {address} is not assigned on the node" in message
    else:
        assert message.startswith("config: ")
        assert f"{HEAD} and {WORKER} have the same fabric_ip {address}" in message
    assert {n.name: ours(n) for n in fault_bed.nodes} == before  # nothing touched
    took = outcome.ended - outcome.started
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{took:.1f} s after the start, before any change"


def test_a_firewall_that_opens_only_the_named_ports(fault_bed: TestBed, row: Row) -> None:
    worker = fault_bed.node(WORKER).ip
    row.fault = (
        f"a firewall drops new TCP to {WORKER}'s fabric IP on the ephemeral ports (the named "
        "ports open, as a firewall opened for the master port only)"
    )
    make_served(fault_bed, vllm=RAY)
    before = {n.name: ours(n) for n in fault_bed.nodes}
    rule = ["OUTPUT", "-p", "tcp", "-d", worker, "--dport", "32768:60999",
            "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"]  # fmt: skip
    subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        outcome = run_flow(fault_bed, vllm=RAY)
    finally:
        subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)
    message = outcome.message
    assert message.startswith(f"fabric-reach: {HEAD} cannot reach {WORKER} at {worker}:"), message
    assert "(no answer within 10 s: a firewall drops the packets)" in message
    assert "Besides the named ports (the API port 30000, the Ray port " in message
    assert "Allow all TCP between the nodes' fabric IPs" in message
    # Named before anything was stopped: the served group is still there and serves.
    assert {n.name: ours(n) for n in fault_bed.nodes} == before
    assert served(fault_bed)
    took = outcome.detected_after(outcome.clock.at("fabric-reach", "running"))
    row.outcome = f"Failed: {first_line(message)}"
    row.detect = f"{took:.1f} s after fabric-reach began, before any change"


def test_a_node_without_python3_checks_its_reach_in_a_container(fault_bed: TestBed) -> None:
    """The reach check runs on a node itself when it has python3; a node without one runs the
    same check in a one-shot container of the image, and the two still meet."""
    path = fault_bed.write_config(fault_bed.root / "reach.toml")
    run = Run(load_config(path, env_file=None))
    since = int(time.time())
    port = pick_port()
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            on_node = pool.submit(reach_on, run, HEAD, port)
            in_container = pool.submit(reach_on, run, WORKER, port, "python3-not-on-this-node")
            reports = [on_node.result(), in_container.result()]
    finally:
        run.close()
    assert [(r.listen, dict(r.reached)) for r in reports] == [
        ("ok", {WORKER: "ok"}),
        ("ok", {HEAD: "ok"}),
    ], reports
    created = {n.name: created_since(n, since) for n in fault_bed.nodes}
    assert created == {HEAD: [], WORKER: [f"{PROJECT}-bed-fabric-reach"]}, created


def created_since(node: EmulatedNode, since: int) -> list[str]:
    with contextlib.closing(node.engine.client()) as client:
        events = client.events(
            since=since, until=int(time.time()) + 1, decode=True,
            filters={"type": "container", "event": "create"},
        )  # fmt: skip
        return [e["Actor"]["Attributes"]["name"] for e in events]


def test_engine_killed_during_load(fault_bed: TestBed, row: Row) -> None:
    row.fault = "engine killed during the load (SIGKILL, exit 137, CUDA OOM in its log)"
    events = fault_bed.observed / "engine-events.jsonl"
    events.unlink(missing_ok=True)
    env = {"VRD_FAULT": "crash_during_load", "VRD_LOAD_SECONDS": "2", "VRD_EVENT_LOG": str(events)}
    # On Ray: what it names is Ray's engine (an mp leader is named as the leader, rank 0).
    outcome = run_flow(fault_bed, vllm={**RAY, "env": env})
    message = outcome.message
    assert message.startswith("wait-ready: ")
    assert f"the vLLM engine on {HEAD} exited with code 137" in message
    assert "CUDA out of memory" in message  # the log tail says why
    crashed = next(
        e["t"] for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "crashed"
    )
    # The flow's own record: when its wait-ready task run ended.
    wait = next(t for t in task_runs(outcome.flow_run_id) if t.name.startswith("wait-ready"))
    took = wait.end_time.timestamp() - crashed
    # Failing fast: far below the 120 s load deadline (the figure itself is in the matrix).
    assert 0 <= took < 30, f"the engine's death took {took:.1f} s to notice"
    for node in fault_bed.nodes:
        assert ours(node, running_only=False) == []
    row.outcome = f"Failed: {first_line(message)} + OOM log tail"
    row.detect = f"{took:.1f} s after the kill (wait-ready end, Prefect's time)"


def test_engine_hangs_and_never_serves(fault_bed: TestBed, row: Row) -> None:
    row.fault = "engine hangs in the load and never serves"
    outcome = run_flow(
        fault_bed, vllm={"env": {"VRD_FAULT": "hang"}}, deadlines={"model_load_s": 8}
    )
    message = outcome.message
    assert message.startswith("wait-ready: ")
    assert "was not served" in message and "within 8 s" in message
    assert "Loading safetensors checkpoint shards" in message  # the last log lines
    took = outcome.detected_after(outcome.clock.at("wait-ready", "running"))
    assert took >= 8
    for node in fault_bed.nodes:
        assert ours(node, running_only=False) == []
    row.outcome = f"Failed: {first_line(message)} + last log lines"
    row.detect = f"{took:.1f} s after the load began (deadline 8 s)"


@pytest.mark.parametrize("where", ["stale-server", "engine-lists-another-name"])
def test_a_server_serving_another_model_is_not_ready(
    fault_bed: TestBed, row: Row, where: str
) -> None:
    head = fault_bed.node(HEAD)
    if where == "stale-server":
        row.fault = "a stale server on the API port serving another model"
        remove_ours(fault_bed)
        head.systemctl("stop", image.OLD_STACK_UNIT)  # it serves the API port
        with StaleServer(head.ip, 30000, "old-model"):
            outcome = run_flow(fault_bed, deadlines={"gpu_release_s": 3})
        message = outcome.message
        # Outside every container and unit the stop takes away: found before anything stops.
        assert message.startswith(f"preflight: {HEAD}: {head.ip}:30000 (the API port) is held by")
        assert "stop-autostart would leave it running" in message
        assert not outcome.clock.reached("stop-autostart")
        row.detect = f"{outcome.ended - outcome.started:.1f} s after the start, before any change"
    else:
        row.fault = "the server on the port lists another model name"
        outcome = run_flow(
            fault_bed,
            vllm={"env": {"VRD_FAULT": "wrong_name:some-other-model"}},
            deadlines={"model_load_s": 300},
        )
        message = outcome.message
        assert message.startswith("wait-ready: ")
        assert "the server lists some-other-model instead" in message
        took = outcome.detected_after(outcome.clock.at("wait-ready", "running"))
        # Once listed, the name never changes: the run does not wait out the deadline.
        assert took < 120, message
        row.detect = f"{took:.1f} s after the load began, as soon as it was listed"
    assert "probe" not in outcome.clock.failed()[1].step
    row.outcome = f"Failed, never ready: {first_line(message)}"


@pytest.mark.parametrize(
    ("fault", "expect"),
    [
        ("http_500", "answered but is not healthy: HTTP 500: "),
        ("html_error", "answered but is not healthy: HTTP 502 and the body is an HTML page"),
        ("malformed_json", "answered but is not healthy: HTTP 200 and the body is not JSON"),
        (
            "garbage",
            "answered but is not healthy: the model repeats '!' 50 times in its reasoning: NaNs "
            "in the weights or kernels",
        ),
        (
            "slow:60",
            f"did not answer: no reply from http://{bed_ip(FIRST_IP)}:30000/v1/chat/completions",
        ),
    ],
    ids=["http-500", "html-error-page", "malformed-json", "garbage", "stall-60s"],
)
def test_probe_gets_a_bad_answer(fault_bed: TestBed, row: Row, fault: str, expect: str) -> None:
    row.fault = f"probe: {fault.replace(':60', ' (a 60 s stall, probe timeout 3 s)')}"
    outcome = run_flow(fault_bed, vllm={"env": {"VRD_FAULT": fault}}, probe={"timeout_s": 3})
    message = outcome.message
    assert message.startswith(f"probe: the model {expect}")
    took = outcome.detected_after(outcome.clock.at("probe", "running"))
    assert took < 45  # never the 60 s of the stall
    if fault == "slow:60":
        assert "within 3 s" in message and took >= 3
    for node in fault_bed.nodes:
        assert ours(node, running_only=False) == []
    row.outcome = f"Failed (unhealthy): {first_line(message).removeprefix('probe: ')}"
    row.detect = f"{took:.1f} s after the probe was sent"


@pytest.mark.timeout(240)
def test_controller_killed_mid_run_next_run_recovers(
    fault_bed: TestBed, row: Row, prefect_api: str
) -> None:
    row.fault = "the controller SIGKILLed during the load; then the next run"
    path = write_config(fault_bed, vllm={**RAY, "env": {"VRD_LOAD_SECONDS": "60"}})
    config = load_config(path, env_file=None)
    head = fault_bed.node(HEAD)
    log = fault_bed.root / "controller.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_REDEPLOY_")}
    with log.open("wb") as out:
        controller = subprocess.Popen(
            [str(Path(sys.executable).parent / "vllm-redeploy"), "run", "--config", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "PREFECT_API_URL": prefect_api},
            cwd=REPO,
        )
    try:

        def loading() -> bool:
            with contextlib.closing(head.engine.client()) as client:
                engines = client.containers.list(filters={"name": engine_container(config)})
                return bool(engines)

        wait_until(loading, 120, "the engine container of the first run", log)
        time.sleep(1)
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
    orphans = {n.name: ours(n) for n in fault_bed.nodes}
    assert orphans[HEAD] == [("engine", "running"), ("ray", "running")], orphans
    outcome = run_flow(fault_bed, vllm=RAY)
    result = outcome.result
    assert result["probe"]["healthy"] and served(fault_bed)
    # It waited until the dead run's lease ran out (renewed every 45 s: 15-60 s left, plus the
    # server's 15 s sweep), then replaced the group.
    assert result["steps"]["cluster-lock"] >= 10, result["steps"]
    assert ours(head, running_only=False) == [("engine", "running"), ("ray", "running")]
    assert ours(fault_bed.node(WORKER), running_only=False) == [("ray", "running")]
    # Nothing told Prefect that the killed run ended: it shows as Running until someone acts.
    zombies = [r for r in running_flow_runs() if r.parameters.get("config_path") == str(path)]
    row.outcome = (
        "Completed on the next run, once the dead run's hold on the cluster expired "
        f"({result['steps']['cluster-lock']:.0f} s): the orphaned group replaced, one engine and "
        f"one Ray container per node; the killed run still shows {len(zombies)}x Running"
    )
    row.detect = f"next run took {outcome.ended - outcome.started:.1f} s"
