"""The redeploy flow end to end on the test bed: real sshd, Docker, Ray and Prefect server."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.test_faults import task_runs
from tests.testbed import image
from tests.testbed.bed import SERVED_NAME, TestBed, bed_ip
from vllm_redeploy.config import load_config
from vllm_redeploy.launch.group import engine_container
from vllm_redeploy.launch.ray import ray_container
from vllm_redeploy.probe import run_probe

pytestmark = pytest.mark.integration
FAST = {"VRD_LOAD_SECONDS": "1"}


@pytest.fixture(scope="module")
def flow_bed(prefect_api: None) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=31, backend="ray")  # its rows name Ray's containers
    try:
        for node in bed.nodes:  # what must survive every run: a stranger's container and files
            with contextlib.closing(node.engine.client()) as client:
                client.containers.run(
                    image.OLD_STACK_IMAGE,
                    ["sleep", "999999"],
                    name="canary",
                    detach=True,
                    network_mode="host",
                    restart_policy={"Name": "unless-stopped"},
                )
        (bed.root / "canary-dir").mkdir()
        (bed.root / "canary-dir" / "weights.bin").write_bytes(b"x" * 1024)
        yield bed
    finally:
        bed.down()


def run_flow(bed: TestBed, mode: str = "redeploy", **changes: Any) -> Any:
    vllm = changes.pop("vllm", {})
    vllm["env"] = {**FAST, **vllm.get("env", {})}
    path = bed.write_config(bed.root / "run.toml", vllm=vllm, **changes)
    return redeploy_vllm_cluster(str(path), mode, return_state=True)


def containers(bed: TestBed) -> dict[str, dict[str, str]]:
    """Per node: container name -> ID, for what runs now."""
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            found[node.name] = {c.name: c.id for c in client.containers.list()}
    return found


def failure(state: Any) -> str:
    assert state.is_failed(), f"expected a failed run, got {state}"
    return str(state.result(raise_on_failure=False))


def served(bed: TestBed) -> bool:
    verdict = run_probe(f"http://{bed.nodes[0].ip}:30000", SERVED_NAME, "Say hello.", 50, 0.0, 10)
    return verdict.healthy


def test_redeploy_after_a_reboot_replaces_the_old_stack(flow_bed: TestBed) -> None:
    for node in flow_bed.nodes:
        flow_bed.reboot(node.name)
    before = containers(flow_bed)
    assert all({"glm-server", "glm-proxy", "canary"} <= set(c) for c in before.values()), before
    state = run_flow(flow_bed)
    assert state.is_completed(), failure(state)
    result = state.result()
    assert result["action"] == "redeployed" and result["probe"]["healthy"]
    assert result["probe"]["finish_reason"] == "length" and result["probe"]["content"] is None
    after = containers(flow_bed)
    config = load_config(flow_bed.root / "run.toml", env_file=None)
    assert set(after["node-1"]) == {"canary", ray_container(config), engine_container(config)}
    assert set(after["node-2"]) == {"canary", ray_container(config)}
    assert after["node-1"]["canary"] == before["node-1"]["canary"]  # untouched, not recreated
    assert (flow_bed.root / "canary-dir" / "weights.bin").stat().st_size == 1024
    assert served(flow_bed)


def test_ensure_on_a_healthy_cluster_changes_nothing(flow_bed: TestBed) -> None:
    before = containers(flow_bed)
    state = run_flow(flow_bed, "ensure")
    assert state.is_completed(), failure(state)
    assert state.result()["action"].startswith("already healthy")
    assert containers(flow_bed) == before


def test_run_command_ensure_reports_and_exits_0(flow_bed: TestBed) -> None:
    result = CliRunner().invoke(
        app, ["run", "-c", str(flow_bed.root / "run.toml"), "--mode", "ensure"]
    )
    assert result.exit_code == 0, result.output
    assert "bed: already healthy: nothing changed" in result.output


def test_probe_command_on_the_served_model(flow_bed: TestBed) -> None:
    result = CliRunner().invoke(
        app, ["probe", "--config", str(flow_bed.root / "run.toml"), "--json"]
    )
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.output)
    assert verdict["healthy"] and verdict["finish_reason"] == "length"
    assert verdict["content"] is None and verdict["reasoning"].startswith("Thinking Process")
    wrong = CliRunner().invoke(
        app, ["probe", "--url", f"http://{flow_bed.nodes[0].ip}:30000", "--model", "not-served"]
    )
    assert wrong.exit_code == 1 and "does not exist" in wrong.output


def test_check_gpus_names_what_holds_them(flow_bed: TestBed) -> None:
    path = str(flow_bed.root / "run.toml")
    serving = json.loads(CliRunner().invoke(app, ["check-gpus", "-c", path, "--json"]).output)
    # While vLLM serves, each node's rank holds its GPU.
    assert all(not row["clear"] and row["processes"] for row in serving)
    assert serving[1]["processes"][0]["name"] == "ray::RayWorkerWrapper"


def test_dry_run_prints_the_plan_and_touches_nothing(flow_bed: TestBed) -> None:
    before = containers(flow_bed)
    result = CliRunner().invoke(app, ["run", "-c", str(flow_bed.root / "run.toml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "remove our earlier containers: vllm-redeploy-bed-engine (running)" in result.output
    assert f"--node-ip-address={bed_ip(32)}" in result.output
    assert "vllm serve" in result.output and "--reasoning-parser qwen3" in result.output
    assert containers(flow_bed) == before


def test_an_empty_answer_fails_the_probe(flow_bed: TestBed) -> None:
    message = failure(run_flow(flow_bed, vllm={"env": {"VRD_FAULT": "empty"}}))
    assert "probe" in message and "empty answer" in message


def test_a_later_run_asks_the_image_nothing_and_finds_what_vllm_compiled(
    flow_bed: TestBed,
) -> None:
    """What preflight learns of an image (its ENTRYPOINT, its Ray) is cached by the image's ID
    across runs: the run after another starts no check container. And what the engine compiled
    at the first start (the stand-in saves it under VLLM_CACHE_ROOT, as vLLM's AOT compile does)
    is in the node's cache directory, which the next start's new container loads it from."""
    cache = flow_bed.root / "compile-cache"  # the bed's [cache] dir
    shutil.rmtree(cache, ignore_errors=True)
    first = run_flow(flow_bed)
    assert first.is_completed(), failure(first)
    assert "this start: cold (graphs compiled and saved" in first.result()["summary"]
    assert list((cache / "vllm" / "torch_compile_cache").rglob("model")), "nothing saved"
    since = int(time.time())
    second = run_flow(flow_bed)
    assert second.is_completed(), failure(second)
    assert "this start: warm (compiled graphs loaded from the cache" in second.result()["summary"]
    with contextlib.closing(flow_bed.nodes[0].engine.client()) as client:
        events = client.events(
            since=since, until=int(time.time()) + 1, decode=True,
            filters={"type": "container", "event": "create"},
        )  # fmt: skip
        created = [e["Actor"]["Attributes"]["name"] for e in events]
    assert "vllm-redeploy-bed-ray" in created, created  # the run did start its containers
    assert [name for name in created if name.endswith("-check")] == [], created
    facts = [r for r in task_runs(second.state_details.flow_run_id) if r.name.startswith("image")]
    assert [(r.name, r.state_name) for r in facts] == [("image-facts[node-1]", "Cached")]


def test_vllm_waits_for_its_engine_as_long_as_we_wait_for_the_load(flow_bed: TestBed) -> None:
    """vLLM bounds its engine's start by VLLM_ENGINE_READY_TIMEOUT_S (600 s unless set; the
    whole start from 0.33 on, see the stand-in). Every container of the group gets
    [deadlines] model_load_s, in whole seconds, unless [vllm.env] sets it; one set there that
    is shorter than the load is named as the cause."""
    newer = {"VRD_VLLM_VERSION": "0.33.0", "VRD_LOAD_SECONDS": "4"}
    short = failure(run_flow(flow_bed, vllm={"env": {**newer, "VLLM_ENGINE_READY_TIMEOUT_S": "1"}}))
    assert "Waited 1s (configured by VLLM_ENGINE_READY_TIMEOUT_S)" in short, short
    assert "leave it out so that it follows [deadlines] model_load_s" in short, short
    state = run_flow(flow_bed, vllm={"env": newer}, deadlines={"model_load_s": 90.5})
    assert state.is_completed(), failure(state)
    config = load_config(flow_bed.root / "run.toml", env_file=None)
    for node in flow_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            ours = [c for c in client.containers.list() if c.name.startswith("vllm-redeploy-")]
            assert ours, node.name
            for container in ours:
                env = container.attrs["Config"]["Env"]
                assert "VLLM_ENGINE_READY_TIMEOUT_S=91" in env, (container.name, env)
    assert config.deadlines.model_load_s == 90.5


def test_canaries_survived_everything(flow_bed: TestBed) -> None:
    assert all("canary" in c for c in containers(flow_bed).values())
    assert (flow_bed.root / "canary-dir" / "weights.bin").exists()
