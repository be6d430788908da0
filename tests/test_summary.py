"""What the operator is told: the run summary (artifact and last screen of `run`), the live
step view, and the README's automation on `vllm.cluster.failed`, end to end on a real server."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console

from deployments.cli.run_view import PlainSteps, StepView
from tasks.stop_autostart import StopReport
from tests.test_probe import THINKING, completion
from tests.testbed.receiver import Receiver, ghost_cluster
from vllm_redeploy.gpus import GpuReport
from vllm_redeploy.launch.backend import GroupMember, GroupStatus
from vllm_redeploy.parsers.nvidia_smi import GPU_FIELDS, parse_compute_apps, parse_gpus
from vllm_redeploy.parsers.vllm_log import LoadProgress
from vllm_redeploy.probe import judge
from vllm_redeploy.summary import (
    RunSummary,
    StepEvent,
    first_words,
    listening,
    render_markdown,
    report,
)

H200 = Path(__file__).parent / "fixtures" / "nvidia_smi" / "h200"
README = Path(__file__).parent.parent / "README.md"
STEPS = {
    "preflight": 1.52,
    "stop-autostart": 3.1,
    "gpus-clear": 0.4,
    "ray-head": 3.2,
    "join-workers": 1.0,
    "cluster-check": 2.5,
    "launch-vllm": 0.8,
    "wait-ready": 912.35,
    "probe": 3.9,
}


def gpu_report(node: str, capture: str, problems: list[str] | None = None) -> GpuReport:
    """A GpuReport from real H200 nvidia-smi captures."""
    text = (H200 / capture / "query-gpu.csv-noheader-nounits.txt").read_text()
    gpus = parse_gpus(text, (*GPU_FIELDS, "utilization.gpu"))  # as captured
    apps = (H200 / capture / "product-query-compute-apps.csv-noheader-nounits.txt").read_text()
    return GpuReport(node, gpus, parse_compute_apps(apps), problems=problems or [])


def full_run(**changes: Any) -> RunSummary:
    summary = RunSummary(
        "spark-pair",
        "redeploy",
        steps=dict(STEPS),
        stopped=[
            StopReport("spark-a", ("glm-server.service",), (), ("glm-server", "glm-proxy"), ()),
            StopReport("spark-b", (), (), (), ("vllm-redeploy-spark-pair-ray",)),
        ],
        gpus=[gpu_report("spark-a", "idle"), gpu_report("spark-b", "idle")],
        group=GroupStatus(
            "ray",
            [GroupMember("192.168.200.12", True, 1.0), GroupMember("192.168.200.13", True, 1.0)],
        ),
        node_ips={"192.168.200.12": "spark-a", "192.168.200.13": "spark-b"},
        endpoint="http://192.168.200.12:30000/v1",
        model="Qwen3.5-122B-A10B-FP8",
        image="vllm/vllm-openai:v0.19.0",
        image_id="sha256:3ae83e92db0d5c7e1b2f",
        vllm_version="0.19.0",
        load_s=908.4,
        loader="instanttensor (auto: the image has it)",
        weights_s=842.13,
        probe=judge(200, completion({"content": None, "reasoning": THINKING}), 3.87),
    )
    for key, value in changes.items():
        setattr(summary, key, value)
    return summary


def test_summary_of_a_redeploy_with_a_reasoning_only_probe() -> None:
    text = render_markdown(full_run())
    lines = text.splitlines()
    assert lines[0] == "# spark-pair: redeployed"
    assert "| step | seconds |" in lines
    assert "| preflight | 1.52 |" in lines and "| wait-ready | 912.35 |" in lines
    assert "Mode `redeploy`, 9 steps in 928.77 s." in lines
    # per node: what was stopped and removed, and the GPU state
    assert (
        "| spark-a | glm-server.service | glm-server, glm-proxy | clear (1 GPU, 0 MiB used) | - |"
        in lines
    )
    assert (
        "| spark-b | none | none; ours from the last run: vllm-redeploy-spark-pair-ray "
        "| clear (1 GPU, 0 MiB used) | - |" in lines
    )
    # the group as its backend listed it: Ray's members by IP and GPUs
    assert "## Group" in lines and "ray: 2 nodes alive, 2 GPUs." in lines
    assert "| spark-b | 192.168.200.13 | 1 | yes |" in lines
    # the image and its version, where it is served, and the load time
    assert "- image `vllm/vllm-openai:v0.19.0` (3ae83e92db0d)" in lines
    assert "- vLLM 0.19.0" in lines
    assert "- `Qwen3.5-122B-A10B-FP8` served at http://192.168.200.12:30000/v1" in lines
    assert "- loaded in 908.4 s" in lines
    # which loader read the weights, why, and how long vLLM itself says it took
    assert "- loader instanttensor (auto: the image has it)" in lines
    assert "- weights loaded in 842.1 s (vLLM's own time)" in lines
    tiny = render_markdown(full_run(weights_s=0.0123)).splitlines()  # the real CPU engine's model
    assert "- weights loaded in 0.01 s (vLLM's own time)" in tiny
    # the verdict, and the first words of the reasoning (markdown in them shown as written)
    assert "- healthy: reasoning only: the token budget ended inside thinking" in lines
    assert "- finish_reason `length`, 3.87 s" in lines
    assert (
        "- reasoning: \u201cThinking Process: 1. \\*\\*Analyze the Request:\\*\\* the user "
        "wants a greeting.\u201d" in lines
    )
    assert not any(line.startswith("- content:") for line in lines)


def test_a_long_answer_is_cut_to_its_first_words() -> None:
    answer = "Hello there! I am a helpful assistant running on two DGX Spark boxes today, friend."
    probe = judge(200, completion({"content": answer, "reasoning": None}, "stop"))
    lines = render_markdown(full_run(probe=probe)).splitlines()
    assert (
        "- content: \u201cHello there! I am a helpful assistant running on two DGX Spark "
        "\u2026\u201d" in lines
    )
    assert first_words("a b c", 2) == "a b \u2026" and first_words(" a  b ", 2) == "a b"


def test_a_busy_gpu_is_named_with_its_process() -> None:
    busy = gpu_report("spark-b", "busy", ["PID 492 (python3) holds 20998 MiB"])
    text = render_markdown(full_run(gpus=[gpu_report("spark-a", "idle"), busy]))
    assert "| PID 492 (python3) holds 20998 MiB |" in text


def test_a_failed_run_says_where_and_why() -> None:
    reason = "the vLLM engine on spark-a exited with code 137 after 61.0 s. Last log lines:\nOOM"
    summary = full_run(
        action="failed at wait-ready",
        failed_step="wait-ready",
        failure=reason,
        steps={**{k: STEPS[k] for k in list(STEPS)[:7]}, "wait-ready": 61.2},
        load_s=None,
        vllm_version=None,
        probe=None,
    )
    text = render_markdown(summary)
    assert text.startswith("# spark-pair: failed at wait-ready\n\n```\nthe vLLM engine on spark-a")
    assert "| wait-ready (failed) | 61.2 |" in text and "| step | seconds |" in text
    assert "## Probe" not in text and "served at" not in text


def test_an_ensure_run_that_changed_nothing() -> None:
    summary = RunSummary("bed", "ensure", "already healthy: nothing changed", {"inspect": 2.1})
    summary.notes.append("reasoning only: the token budget ended inside thinking")
    lines = render_markdown(summary).splitlines()
    assert lines[0] == "# bed: already healthy: nothing changed"
    assert "| inspect | 2.1 |" in lines and "## Nodes" not in lines
    assert "- reasoning only: the token budget ended inside thinking" in lines


# --- live progress ---------------------------------------------------------------------------


def test_listeners_get_events_only_while_listening_and_cannot_break_the_run() -> None:
    seen: list[StepEvent] = []

    def broken(event: StepEvent) -> None:
        raise RuntimeError("a display bug")

    with listening(broken), listening(seen.append):
        report(StepEvent("preflight", "running"))
    report(StepEvent("preflight", "done", 1.0))
    assert seen == [StepEvent("preflight", "running")]


def render(view: StepView) -> str:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    console.print(view)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_step_view_shows_each_step_and_the_load_bar() -> None:
    view = StepView("spark-pair: redeploy")
    view(StepEvent("preflight", "running"))
    view(StepEvent("preflight", "done", 1.52))
    view(StepEvent("wait-ready", "running"))
    view(StepEvent("wait-ready", "loading", load=LoadProgress(45, 18, 40)))
    text = render(view)
    assert text.splitlines()[0] == "spark-pair: redeploy"
    assert re.search(r"✓\s+preflight\s+1\.5 s", text)
    assert re.search(r"wait-ready\s+\d+\.\d s\s+━+.*45% 18/40 shards", text)
    view(StepEvent("wait-ready", "failed", 75.0, "the engine exited"))
    assert re.search(r"✗\s+wait-ready\s+1:15", render(view))


def test_plain_steps_print_one_line_per_finished_step() -> None:
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    plain = PlainSteps(console)
    for event in (
        StepEvent("preflight", "running"),
        StepEvent("preflight", "done", 1.52),
        StepEvent("wait-ready", "loading", load=LoadProgress(45, 18, 40)),
        StepEvent("wait-ready", "failed", 61.2, "exited"),
    ):
        plain(event)
    output = console.file.getvalue()  # type: ignore[attr-defined]
    assert output == "preflight: done in 1.5 s\nwait-ready: failed after 61.2 s\n"


# --- the README's automation, on a real Prefect server ---------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver("127.0.0.96")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def readme_automation() -> dict[str, Any]:
    text = README.read_text()
    section = text[text.index("### Automations") :]
    block = section[section.index("```yaml\n") + len("```yaml\n") :]
    return yaml.safe_load(block[: block.index("```")])


def _until_armed(prefect_api: str, receiver: Receiver) -> None:
    """Post a `vllm.cluster.failed` of a throwaway cluster until its notification comes back.

    Prefect's triggers service loads a new automation on its next periodic pass (every 5 s, later
    on busy cores) and an event that arrives before that is never matched: without this, the run's
    own event can beat its automation (seen on CI)."""
    resource = f"vllm-redeploy.cluster.armed{uuid.uuid4().hex[:6]}"
    deadline = time.monotonic() + 120
    while not any(resource in b["body"] for b in receiver.bodies):
        assert time.monotonic() < deadline, f"the automation never fired: {receiver.bodies}"
        event = {
            "id": str(uuid.uuid4()),
            "event": "vllm.cluster.failed",
            "occurred": datetime.now(UTC).isoformat(),
            "resource": {"prefect.resource.id": resource},
            "payload": {"step": "arming", "reason": "is the automation loaded yet?"},
        }
        httpx.post(f"{prefect_api}/events", json=[event], timeout=10).raise_for_status()
        time.sleep(3)


@pytest.mark.integration
def test_readme_automation_notifies_when_a_run_fails(
    prefect_api: str, receiver: Receiver, tmp_path: Path
) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from flows.redeploy import redeploy_vllm_cluster

    host, port = str(receiver.server_address[0]), int(receiver.server_address[1])
    block_name = f"vrd-test-{uuid.uuid4().hex[:8]}"
    block_id = CustomWebhookNotificationBlock(
        name="operator",
        url=f"http://{host}:{port}/notify",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save(block_name)
    automation = readme_automation()
    automation["name"] = f"{automation['name']}-{block_name}"
    automation["actions"][0]["block_document_id"] = str(block_id)
    spec = tmp_path / "cluster-failed.yaml"
    spec.write_text(yaml.safe_dump(automation))
    prefect = str(Path(sys.executable).parent / "prefect")
    created = subprocess.run(
        [prefect, "automation", "create", "--from-file", str(spec)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    automation_id = re.search(r"with id\s+([0-9a-f-]{36})", created.stdout)
    assert automation_id, created.stdout
    try:
        _until_armed(prefect_api, receiver)
        # A real run that fails: its only node never answers (nothing listens on the port).
        cluster = f"nobody{uuid.uuid4().hex[:6]}"
        config = ghost_cluster(tmp_path / "cluster.toml", cluster, "127.0.0.97")
        state = redeploy_vllm_cluster(str(config), "redeploy", return_state=True)
        assert state.is_failed()
        deadline = time.monotonic() + 120
        mine: list[dict[str, Any]] = []
        while not mine:
            mine = [b for b in receiver.bodies if f"vllm-redeploy.cluster.{cluster}" in b["body"]]
            assert time.monotonic() < deadline, receiver.bodies
            time.sleep(0.5)
        note = mine[0]
        assert note["subject"] == f"vllm-redeploy.cluster.{cluster} failed at preflight"
        assert "node ghost did not come back within 1 s" in note["body"]
        # the run's name says its cluster, trigger and mode (not one of Prefect's random names)
        assert f"Flow run {cluster}-manual-redeploy: its summary" in note["body"], note["body"]
    finally:
        httpx.delete(f"{prefect_api}/automations/{automation_id.group(1)}", timeout=10)
