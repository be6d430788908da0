"""`vllm-redeploy status` and `vllm-redeploy run` on the test bed: real sshd, Docker, Ray, the vLLM
stand-in and a real Prefect server. What a person or a script reads from them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from markdown_it import MarkdownIt
from typer.testing import CliRunner

from deployments.cli import app
from deployments.event_sender import EventSender
from deployments.watcher import ClusterWatcher
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.testbed.bed import SERVED_NAME, TestBed, bed_ip
from tests.testbed.procs import kill_in_container
from tests.testbed.trickler import answer, server, trickle
from vllm_redeploy.config import NodeConfig, load_config
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.launch.backend import GroupStatus
from vllm_redeploy.launch.group import engine_container
from vllm_redeploy.launch.mp import follower_container
from vllm_redeploy.launch.ray import ray_container
from vllm_redeploy.names import artifact_key, cluster_tag
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.status import (
    ContainerStatus,
    EndpointStatus,
    NodeStatus,
    collect_status,
    judge,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]  # a bed and a flow run
CLI = Path(sys.executable).parent / "vllm-redeploy"
ANSI = re.compile(r"\x1b\[")
# The deployed cluster's own name: the session's Prefect server is shared by every module on the
# worker, and one that served a nightly schedule for the bed's default name ("bed") made its
# scheduled run this cluster's "next run".
CLUSTER = f"status-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def deployed(prefect_api: str) -> Iterator[tuple[TestBed, Path]]:
    """A bed with the deployment running, brought up by one real flow run."""
    bed = make_bed(2, "h200", first_ip=91, backend="ray")  # status reports Ray's members
    try:
        path = bed.write_config(
            bed.root / "run.toml", name=CLUSTER, vllm={"env": {"VRD_LOAD_SECONDS": "1"}}
        )
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
        assert state.is_completed(), state.result(raise_on_failure=False)
        yield bed, path
    finally:
        bed.down()


def status_json(path: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, ["status", "-c", str(path), "--json"])
    (report,) = json.loads(result.output)  # a list, one per cluster, even for one
    return result.exit_code, report


def piped(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a script runs it: its own process, stdout and stderr into pipes."""
    environ = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        timeout=110,
        env={**environ, "TERM": "xterm-256color", **(env or {})},
    )


def test_status_of_a_healthy_deployment(deployed: tuple[TestBed, Path]) -> None:
    bed, path = deployed
    code, report = status_json(path)
    assert code == 0, report["problems"]
    assert report["healthy"] and report["problems"] == []
    assert report["last_run"]["name"] == f"{CLUSTER}-manual-redeploy", report["last_run"]
    assert report["last_run"]["state"] == "Completed" and report["next_run"] is None
    config = load_config(path, env_file=None)
    head, worker = report["nodes"]
    assert [n["name"] for n in report["nodes"]] == ["node-1", "node-2"]
    for node in (head, worker):
        assert node["reachable"] and node["rtt_ms"] > 0 and node["error"] is None
        # while vLLM serves, each node's rank holds its GPU
        assert not node["gpu"]["clear"]
        (holder,) = node["gpu"]["holders"]
        assert holder["pid"] > 0 and holder["memory_mib"] > 100_000
    assert worker["gpu"]["holders"][0]["name"] == "ray::RayWorkerWrapper"
    running = {c["name"]: c for c in head["containers"] if c["running"]}
    assert set(running) == {ray_container(config), engine_container(config)}
    assert running[engine_container(config)]["role"] == "engine"
    assert 0 <= running[engine_container(config)]["uptime_s"] < 600
    assert [c["name"] for c in worker["containers"]] == [ray_container(config)]
    assert report["group"]["backend"] == "ray"
    members = report["group"]["members"]
    assert sorted((m["ip"], m["alive"], m["gpus"]) for m in members) == [
        (bed.nodes[0].ip, True, 1.0),
        (bed.nodes[1].ip, True, 1.0),
    ]
    endpoint = report["endpoint"]
    assert endpoint["url"] == f"http://{bed.nodes[0].ip}:30000/v1"
    assert endpoint["models"] == [SERVED_NAME] and endpoint["served"]
    assert endpoint["health"] == 200 and endpoint["version"] == "0.19.0"
    assert endpoint["probe"]["healthy"] and endpoint["probe"]["finish_reason"] == "length"
    assert endpoint["engine"]["running"] and endpoint["engine"]["uptime_s"] >= 0


def test_status_piped_is_plain_text(deployed: tuple[TestBed, Path]) -> None:
    bed, path = deployed
    result = piped("status", "-c", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not ANSI.search(result.stdout + result.stderr)
    text = result.stdout
    assert text.splitlines()[0] == f"cluster {CLUSTER}: healthy"
    # the header: the cluster's last run (the fixture's); no schedule is served here
    (last,) = [line for line in text.splitlines()[:4] if line.startswith("last run")]
    when, took = r"\d{4}-\d\d-\d\d \d\d:\d\d", r"\d+ (s|min \d+ s)"
    assert re.fullmatch(
        rf"last run   {CLUSTER}-manual-redeploy {when}, Completed after {took}", last
    )
    assert "next run" not in text
    assert "watcher    never seen: no `vllm-redeploy watch` looks at it" in text
    assert re.search(
        rf"node-1 head .*yes \d+\.\d ms .*vllm-redeploy-{CLUSTER}-engine running", text
    )
    assert "held by PID" in text and "ray::RayWorkerWrapper" in text
    assert f"alive at {bed.nodes[1].ip}, 1 GPU" in text
    assert re.search(rf"model\s+{re.escape(SERVED_NAME)} \(/v1/models\)", text)
    assert re.search(r"probe\s+healthy: reasoning only", text)
    assert re.search(r"engine\s+running, up \d+", text)


def test_status_names_the_next_scheduled_run(
    deployed: tuple[TestBed, Path], prefect_api: str
) -> None:
    """As the nightly deployment's schedule leaves one: Scheduled, tagged with the cluster."""
    _, path = deployed
    due = datetime.now(UTC) + timedelta(hours=5)
    flow = httpx.post(f"{prefect_api}/flows/", json={"name": "redeploy-vllm-cluster"}, timeout=10)
    created = httpx.post(
        f"{prefect_api}/flow_runs/",
        json={
            "flow_id": flow.json()["id"],
            "tags": [cluster_tag(CLUSTER)],
            "parameters": {"trigger": "nightly", "mode": "redeploy"},
            "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": due.isoformat()}},
        },
        timeout=10,
    ).json()
    try:
        text = piped("status", "-c", str(path)).stdout
        assert f"next run   nightly, due {due.astimezone():%Y-%m-%d %H:%M}" in text, text
        _, report = status_json(path)
        assert report["next_run"]["trigger"] == "nightly"
        assert datetime.fromisoformat(report["next_run"]["due"]) == due
    finally:
        httpx.delete(f"{prefect_api}/flow_runs/{created['id']}", timeout=10)


def test_the_run_command_piped_prints_a_line_per_step_then_the_summary(
    deployed: tuple[TestBed, Path], prefect_api: str
) -> None:
    _, path = deployed
    result = piped("run", "-c", str(path), env={"PREFECT_API_URL": prefect_api})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not ANSI.search(result.stdout)
    first, *lines = result.stdout.splitlines()
    # the flow run first: its name (cluster, trigger, mode) and its page in the UI
    ui = prefect_api.removesuffix("/api")
    found = re.fullmatch(
        rf"flow run {CLUSTER}-manual-redeploy: {re.escape(ui)}/runs/flow-run/(\S+)", first
    )
    assert found, first
    flow_run = httpx.get(f"{prefect_api}/flow_runs/{found[1]}", timeout=10).json()
    assert flow_run["name"] == f"{CLUSTER}-manual-redeploy"
    assert flow_run["parameters"]["config_path"] == str(path)
    steps = [line.split(":")[0] for line in lines[: lines.index(f"# {CLUSTER}: redeployed")]]
    assert steps == [
        "guard",
        "cluster-lock",
        "preflight",
        "fabric-reach",
        "stop-autostart",
        "gpus-clear",
        "memory",
        "ports-free",
        "ray-head",
        "join-workers",
        "cluster-check",
        "launch-vllm",
        "wait-ready",
        "transport",
        "probe",
    ]
    assert all(re.fullmatch(r"[a-z-]+: done in \d+\.\d s", line) for line in lines[:14])
    summary = "\n".join(lines[14:])
    assert "| step | seconds |" in summary and "| wait-ready |" in summary
    # what was stopped on each node: this time our own containers of the last run
    assert (
        f"ours from the last run: vllm-redeploy-{CLUSTER}-engine, vllm-redeploy-{CLUSTER}-ray"
        in summary
    )
    assert "- vLLM 0.19.0" in summary and f"served at http://{bed_ip(91)}:30000/v1" in summary
    assert "- healthy: reasoning only: the token budget ended inside thinking" in summary
    assert "- reasoning: \u201cThinking Process:" in summary


def test_a_rank_killed_inside_a_live_container_is_found_by_a_generation(
    deployed: tuple[TestBed, Path],
) -> None:
    """vLLM's Ray executor assumes its ranks are healthy: a RayWorkerWrapper killed inside the
    worker's Ray container (an OOM kill) leaves the containers up, /health and /v1/models 200.
    The quick look calls that healthy; the generation (every few looks) gets HTTP 500."""
    bed, path = deployed
    config = load_config(path, env_file=None)
    with contextlib.closing(bed.nodes[1].engine.client()) as client:
        kill_in_container(client.containers.get(ray_container(config)), "RayWorkerWrapper")
    quick = collect_status(config, quick=True)
    assert quick.healthy, quick.problems
    assert quick.endpoint.health == 200 and quick.endpoint.models == [config.vllm.served_name]
    status = collect_status(config, quick=True, generate=True)
    generation = status.endpoint.generation
    assert generation is not None and generation.verdict == "failed", generation
    assert "HTTP 500" in generation.detail and generation.detail in status.problems


def test_status_after_the_engine_is_gone(deployed: tuple[TestBed, Path]) -> None:
    _, path = deployed
    config = load_config(path, env_file=None)
    with NodeAccess(config.head, config) as head:
        head.docker.remove(engine_container(config))
    code, report = status_json(path)
    assert code == 1 and not report["healthy"]
    assert "the vLLM engine on node-1 is not running" in report["problems"]
    assert report["endpoint"]["engine"] is None and not report["endpoint"]["served"]
    result = piped("status", "-c", str(path))
    assert result.returncode == 1
    assert not ANSI.search(result.stdout + result.stderr)
    assert re.search(r"engine\s+not running", result.stdout)
    assert "  - the vLLM engine on node-1 is not running" in result.stdout
    assert result.stdout.startswith(f"cluster {CLUSTER}: not healthy")


def test_a_trickle_on_the_api_port_costs_status_and_a_look_seconds(
    deployed: tuple[TestBed, Path], prefect_api: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine is gone and something else holds its port (host networking: any process
    may bind it), answering a byte a second: every read of ours has a total deadline, so
    `status` answers and the watcher's look counts a bad look within its interval."""
    _, path = deployed
    config = load_config(path, env_file=None)
    with NodeAccess(config.head, config) as head:
        head.docker.remove(engine_container(config))
    slow = trickle(answer(b'{"data": []}' + b" " * 600), every_s=1.0)
    with server(slow, config.head.address, config.vllm.port):
        began = time.monotonic()
        result = subprocess.run(
            ["timeout", "60", str(CLI), "status", "-c", str(path), "--json"],
            capture_output=True,
            text=True,
        )
        took = time.monotonic() - began
        assert result.returncode == 1, (result.returncode, took, result.stderr[-2000:])
        (report,) = json.loads(result.stdout)
        problems = report["problems"]
        assert f"{api_base(config)}/v1/models does not answer: no answer in time" in problems
        sender = EventSender(prefect_api)
        watcher = ClusterWatcher(config, sender)
        began = time.monotonic()
        with caplog.at_level(logging.INFO, logger="vllm_redeploy.watch"):
            watcher.look_once()
        took = time.monotonic() - began
        sender.close()
    assert watcher.state.bad == 1, caplog.text
    assert "does not answer: no answer in time" in caplog.text
    assert took < config.watch.interval_s, took


# --- foreign values on the way to a person (issue 12) ---------------------------------------

# A newline, a carriage return, "clear the screen" and rich markup, served as the model's name.
NASTY = "evil\n\r\x1b[2J[bold]x"


def in_terminal(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """The CLI in a pseudo-terminal, as a person runs it: what the terminal receives."""
    import pty
    import select

    master, slave = pty.openpty()
    environ = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    proc = subprocess.Popen(
        [str(CLI), *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**environ, "TERM": "xterm-256color", "COLUMNS": "160", **env},
        close_fds=True,
    )
    os.close(slave)
    received = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its side
                break
            if not chunk:
                break
            received += chunk
        elif proc.poll() is not None:
            break
    code = proc.wait(timeout=120)
    os.close(master)
    return code, received.decode("utf-8", "replace")


def assert_nasty_shown_safely(text: str) -> None:
    """The value reached the person escaped: as text, not as a newline or a screen clear."""
    assert "\x1b[2J" not in text and "evil\n" not in text and "evil\r" not in text
    assert r"'evil\n\r\x1b[2J[bold]x'" in text, text[-3000:]


def test_hostile_values_reach_the_terminal_and_the_summary_escaped(
    deployed: tuple[TestBed, Path], prefect_api: str
) -> None:
    """A server that names its model with control characters and markup: the run view in a
    terminal, the piped failure, the failure summary artifact and `status` all show the name
    escaped, on one line."""
    bed, _ = deployed
    path = bed.write_config(
        bed.root / "nasty.toml",
        name=CLUSTER,  # the deployed group's cluster
        vllm={"env": {"VRD_LOAD_SECONDS": "1", "VRD_FAULT": f"wrong_name:{NASTY}"}},
        # The run stops as soon as the name is listed; the deadline only bounds a failed start.
        deadlines={"model_load_s": 300},
    )
    env = {"PREFECT_API_URL": prefect_api}
    code, shown_in_terminal = in_terminal("run", "-c", str(path), "--keep-on-failure", env=env)
    assert code == 1, shown_in_terminal[-3000:]
    assert "failed at wait-ready" in shown_in_terminal
    assert_nasty_shown_safely(shown_in_terminal)

    summary = latest_summary(prefect_api)
    tokens = MarkdownIt("commonmark").enable("table").parse(summary)
    assert (
        tokens[0].type == "heading_open" and tokens[1].content == f"{CLUSTER}: failed at wait-ready"
    )
    (failure,) = [t.content for t in tokens if t.type == "fence"]
    assert failure.startswith(f"{SERVED_NAME} is not served")
    assert_nasty_shown_safely(failure)

    # The group was kept (--keep-on-failure): the server still lists the hostile name.
    result = piped("status", "-c", str(path))
    assert result.returncode == 1
    assert_nasty_shown_safely(result.stdout)
    problem = next(line for line in result.stdout.splitlines() if "/models lists" in line)
    assert problem.endswith(f"lists {NASTY!r}, not {SERVED_NAME}"), problem
    code, status_in_terminal = in_terminal("status", "-c", str(path), env={})
    assert code == 1
    assert_nasty_shown_safely(status_in_terminal)
    assert "[bold]" in status_in_terminal  # literally: rich did not take it as markup


def latest_summary(api_url: str) -> str:
    import httpx

    found = httpx.post(
        f"{api_url}/artifacts/latest/filter",
        json={"artifacts": {"key": {"any_": [artifact_key(CLUSTER, "summary")]}}, "limit": 1},
        timeout=10,
    )
    found.raise_for_status()
    return found.json()[0]["data"]


def test_a_follower_without_its_leader_is_named() -> None:
    """The real vLLM's followers outlive their leader (tests/test_real_vllm.py shows it); status
    says so, from what runs (their backend label), and says nothing of it while the leader runs
    or cannot be seen."""
    config = load_config(Path(__file__).parents[1] / "cluster.example.toml", env_file=None)
    head, worker = config.nodes

    def node(n: NodeConfig, role: str, *running: str, reachable: bool = True) -> NodeStatus:
        containers = [ContainerStatus(name, "", "running", True, backend="mp") for name in running]
        return NodeStatus(n.name, n.address, n.ip, role, reachable, containers=containers)

    follower = node(worker, "worker", follower_container(config))
    endpoint = EndpointStatus("http://x/v1", "m", None, "refused", None, None, None)
    orphaned = (
        f"the vLLM follower on {worker.name} still runs without the vLLM leader (rank 0), and "
        "cannot join a new one; the next run (or ensure) replaces the whole group"
    )
    alone = judge(config, [node(head, "head"), follower], GroupStatus(), endpoint)
    assert orphaned in alone, alone
    led = [node(head, "head", engine_container(config)), follower]
    assert orphaned not in judge(config, led, GroupStatus(), endpoint)
    unseen = [node(head, "head", reachable=False), follower]
    assert orphaned not in judge(config, unseen, GroupStatus(), endpoint)
