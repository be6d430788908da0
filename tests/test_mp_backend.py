"""vLLM's own multi-node launcher, end to end (issue 15): the flow on beds whose image carries no
Ray (the stand-in implements `--nnodes/--node-rank/--master-addr/--headless` with a real TCP
rendezvous), `auto` choosing the backend from the image, the failures a follower can cause, and
`ensure` and `status` reading the backend from what runs; and a toy third backend, to show that
one is a plan and a line in vllm_redeploy/launch/choose.py."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.testbed import image
from tests.testbed.bed import TestBed
from tests.testbed.procs import freeze_container
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.dry_run import launch_lines
from vllm_redeploy.launch import LaunchPlan, NodeFabric, Phase, plan_for
from vllm_redeploy.launch import mp as mp_launch
from vllm_redeploy.launch.choose import BACKENDS, register
from vllm_redeploy.launch.group import LABEL_BACKEND
from vllm_redeploy.nodes.containers import LABEL_MANAGED
from vllm_redeploy.status import collect_status
from vllm_redeploy.summary import StepEvent, listening

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CLI = Path(sys.executable).parent / "vllm-redeploy"
FAST = {"VRD_LOAD_SECONDS": "2"}


@pytest.fixture(scope="module")
def mp_bed(prefect_api: str) -> Iterator[TestBed]:
    # `auto`, the product's default: these rows check what it chooses from the image.
    bed = make_bed(4, "h200", first_ip=61, vllm_image=image.NO_RAY_IMAGE, backend="auto")
    yield bed
    bed.down()


@pytest.fixture(autouse=True)
def no_group_left(mp_bed: TestBed) -> Iterator[None]:
    yield
    for node in mp_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True, filters={"label": LABEL_MANAGED}):
                c.remove(force=True)


def cluster(bed: TestBed, nodes: int, name: str, **sections: dict[str, Any]) -> Path:
    """A cluster of the bed's first ``nodes`` nodes (TP across all of them)."""
    from tests.testbed.bed import to_toml

    data = bed.settings()
    data["nodes"] = data["nodes"][:nodes]
    data["vllm"]["tensor_parallel_size"] = nodes
    data["vllm"]["env"] |= FAST
    for section, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(data.get(section, {}).get(key), dict):
                data[section][key] |= value
            else:
                data.setdefault(section, {})[key] = value
    path = bed.root / f"{name}.toml"
    path.write_text(to_toml(data))
    return path


def ours(bed: TestBed) -> dict[str, dict[str, str]]:
    """Per node: our running containers and their role."""
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            found[node.name] = {
                c.name: c.labels.get("io.vllm-redeploy.role", "?")
                for c in client.containers.list(filters={"label": LABEL_MANAGED})
            }
    return found


@pytest.mark.parametrize("nodes", [2, 4])
def test_mp_serves_after_a_reboot_with_the_old_stack_back(mp_bed: TestBed, nodes: int) -> None:
    for node in mp_bed.nodes[:nodes]:
        mp_bed.reboot(node.name)  # the old model's stack auto-starts again
    state = redeploy_vllm_cluster(str(cluster(mp_bed, nodes, f"mp{nodes}")), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    keep_for_notes(f"summary-mp-{nodes}", result["summary"])
    steps = list(result["steps"])
    assert steps[steps.index("ports-free") + 1 :] == [
        "launch-vllm",  # every rank at once
        "wait-ready",
        "transport",
        "probe",
    ]
    assert result["probe"]["healthy"] and result["probe"]["finish_reason"] == "length"
    assert (
        "- backend mp (the image's vLLM has --nnodes; vLLM's own multi-node launcher)"
        in (result["summary"])
    )
    running = ours(mp_bed)
    assert running["node-1"] == {"vllm-redeploy-bed-engine": "leader"}
    for node in mp_bed.nodes[1:nodes]:
        assert running[node.name] == {"vllm-redeploy-bed-follower": "follower"}
    for node in mp_bed.nodes[nodes:]:
        assert running[node.name] == {}
    # The old stack is gone, and each follower ran with its own rank, headless.
    with contextlib.closing(mp_bed.nodes[nodes - 1].engine.client()) as client:
        follower = client.containers.get("vllm-redeploy-bed-follower")
        args = follower.attrs["Config"]["Cmd"]
        assert args[args.index("--node-rank") + 1] == str(nodes - 1) and "--headless" in args
        assert follower.labels[LABEL_BACKEND] == "mp"


def test_auto_takes_mp_on_an_image_with_ray_and_ray_only_for_a_vllm_without_nnodes(
    mp_bed: TestBed,
) -> None:
    """An image that carries Ray and whose vLLM has --nnodes takes vLLM's own launcher (no Ray
    to start); one whose vLLM predates it (0.10: its help lists no --nnodes) takes Ray."""
    path = cluster(mp_bed, 2, "auto-ray-image", vllm={"image": image.BED_IMAGE})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    assert "ray-head" not in result["steps"] and "launch-vllm" in result["steps"]
    assert (
        "- backend mp (the image's vLLM has --nnodes; vLLM's own multi-node launcher)"
        in result["summary"]
    )
    old = {"image": image.OLD_VLLM_IMAGE}
    state = redeploy_vllm_cluster(str(cluster(mp_bed, 2, "auto-old", vllm=old)), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    assert "ray-head" in result["steps"] and "cluster-check" in result["steps"]
    assert "- backend ray (the image carries Ray at " in result["summary"]


def test_a_ray_group_started_before_auto_took_mp_is_kept_by_ensure(mp_bed: TestBed) -> None:
    """Upgrading vllm-redeploy alone replaces nothing: a Ray group that auto chose before it
    preferred vLLM's own launcher (the registry's order then: Ray first) keeps serving."""
    path = cluster(mp_bed, 2, "auto-upgrade", vllm={"image": image.BED_IMAGE})
    now = dict(BACKENDS)
    BACKENDS.clear()
    BACKENDS.update({"ray": now["ray"], "mp": now["mp"]})
    try:
        state = redeploy_vllm_cluster(str(path), return_state=True)
    finally:
        BACKENDS.clear()
        BACKENDS.update(now)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert "- backend ray (the image carries Ray at " in state.result()["summary"]
    before = running_ids(mp_bed)
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.result()["action"] == "already healthy: nothing changed", state.result()
    assert running_ids(mp_bed) == before


def running_ids(bed: TestBed) -> dict[str, str]:
    """Our running containers' IDs, by name and node: what a redeploy would replace."""
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(filters={"label": LABEL_MANAGED}):
                found[f"{node.name}/{c.name}"] = c.id
    return found


def served_args(bed: TestBed, node: int, name: str) -> list[str]:
    with contextlib.closing(bed.nodes[node].engine.client()) as client:
        return list(client.containers.get(name).attrs["Config"]["Cmd"])


def test_auto_loads_with_the_fastest_loader_the_image_has(mp_bed: TestBed) -> None:
    """An image whose Python has InstantTensor and fastsafetensors loads with InstantTensor,
    on every rank's command line; wait-ready follows its bar (in bytes) and the summary says
    which loader and vLLM's own time for the weights."""
    seen: list[StepEvent] = []
    slow = {"image": image.LOADERS_IMAGE, "env": {"VRD_LOAD_SECONDS": "12"}}
    with listening(seen.append):
        state = redeploy_vllm_cluster(
            str(cluster(mp_bed, 2, "instanttensor", vllm=slow)), return_state=True
        )
    assert state.is_completed(), state.result(raise_on_failure=False)
    summary = state.result()["summary"]
    keep_for_notes("summary-instanttensor", summary)
    assert "- loader instanttensor (auto: the image has it)" in summary
    assert re.search(r"- weights loaded in \d+\.\d+ s \(vLLM's own time\)", summary), summary
    for node, name in ((0, "vllm-redeploy-bed-engine"), (1, "vllm-redeploy-bed-follower")):
        args = served_args(mp_bed, node, name)
        assert args[args.index("--load-format") + 1] == "instanttensor"
    loads = [e.load for e in seen if e.state == "loading" and e.load is not None]
    moving = [load for load in loads if 0 < load.percent < 100]
    assert moving and all(load.loader == "instanttensor" and load.amount for load in moving)
    assert loads[-1].percent == 100, loads


def test_fastsafetensors_alone_or_a_load_format_in_extra_args(mp_bed: TestBed) -> None:
    """An image with fastsafetensors only (and Ray) loads with it; a --load-format in
    extra_args wins over auto and is passed once."""
    path = cluster(mp_bed, 2, "fastsafetensors", vllm={"image": image.FASTSAFETENSORS_IMAGE})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    summary = state.result()["summary"]
    assert "- loader fastsafetensors (auto: the image has it)" in summary
    assert "- backend mp (the image's vLLM has --nnodes" in summary
    args = served_args(mp_bed, 0, "vllm-redeploy-bed-engine")
    assert args[args.index("--load-format") + 1] == "fastsafetensors"
    given = {"image": image.LOADERS_IMAGE, "extra_args": ["--load-format", "safetensors"]}
    state = redeploy_vllm_cluster(
        str(cluster(mp_bed, 2, "extra-loader", vllm=given)), return_state=True
    )
    assert state.is_completed(), state.result(raise_on_failure=False)
    # (markdown's own characters escaped, as the summary shows every foreign word)
    assert (
        "- loader safetensors (from \\[vllm\\] extra\\_args, which wins)"
        in state.result()["summary"]
    )
    args = served_args(mp_bed, 0, "vllm-redeploy-bed-engine")
    assert args.count("--load-format") == 1 and "instanttensor" not in args


def test_ray_on_an_image_without_ray_fails_preflight_with_the_fix(mp_bed: TestBed) -> None:
    state = redeploy_vllm_cluster(
        str(cluster(mp_bed, 2, "ray-noray", vllm={"backend": "ray"})), return_state=True
    )
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and message.startswith("preflight: node-1: `ray` does not run")
    assert 'set backend = "mp"' in message
    assert ours(mp_bed)["node-1"] == {}


def test_a_follower_killed_during_the_load_fails_the_wait_at_once(mp_bed: TestBed) -> None:
    path = cluster(mp_bed, 2, "killed", vllm={"env": {"VRD_LOAD_SECONDS": "60"}})
    worker = mp_bed.nodes[1]
    killed: list[float] = []

    def kill_when_loading() -> None:
        """Once the group loads (the leader says so; its ranks load together)."""
        deadline = time.monotonic() + 120
        with (
            contextlib.closing(mp_bed.nodes[0].engine.client()) as head,
            contextlib.closing(worker.engine.client()) as client,
        ):
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    leader = head.containers.get("vllm-redeploy-bed-engine")
                    if "Starting to load model" in leader.logs().decode():
                        client.containers.get("vllm-redeploy-bed-follower").kill()
                        killed.append(time.monotonic())
                        return
                time.sleep(0.2)

    thread = threading.Thread(target=kill_when_loading, daemon=True)
    thread.start()
    state = redeploy_vllm_cluster(str(path), return_state=True)
    noticed = time.monotonic()
    thread.join(10)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and killed, message
    assert message.startswith("wait-ready: the vLLM follower on node-2 exited with code 137")
    assert noticed - killed[0] < 45  # long before the 60 s load would have ended
    assert all(found == {} for found in ours(mp_bed).values())  # the whole group was removed


def test_the_leader_killed_during_the_load_is_named_with_its_exit(mp_bed: TestBed) -> None:
    """The out-of-memory kill of vLLM's process, PID 1 of the leader's container (the follower
    then exits too, having lost its leader)."""
    path = cluster(mp_bed, 2, "leader-oom", vllm={"env": {"VRD_FAULT": "crash_during_load"}})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed()
    assert "the vLLM leader (rank 0) on node-1 exited with code 137" in message, message
    assert "out-of-memory killer" in message
    assert all(found == {} for found in ours(mp_bed).values())  # the whole group was removed


def test_a_follower_that_cannot_reach_the_leader_is_named(mp_bed: TestBed) -> None:
    worker = mp_bed.nodes[1]
    path = cluster(
        mp_bed,
        2,
        "firewalled",
        vllm={"env": {"VRD_FAULT": f"firewall:{worker.ip}"}},
        deadlines={"rendezvous_s": 6},
    )
    state = redeploy_vllm_cluster(str(path), return_state=True)
    message = str(state.result(raise_on_failure=False))
    keep_for_notes("failure-rendezvous", message)
    assert state.is_failed()
    assert message.startswith(
        f"wait-ready: node-2 never joined the rendezvous at {mp_bed.nodes[0].ip}:"
    ), message
    assert "the follower on node-2 holds no connection to it" in message
    assert "Last log lines on node-2:" in message and "headless multiproc executor" in message
    assert "Last log lines of the leader on node-1:" in message
    assert "distributed_init_method=tcp://" in message


def test_ensure_and_status_read_the_backend_from_what_runs(mp_bed: TestBed) -> None:
    path = cluster(mp_bed, 2, "ensure")
    assert redeploy_vllm_cluster(str(path), return_state=True).is_completed()
    config = load_config(path, env_file=None)
    status = collect_status(config)
    assert status.healthy, status.problems
    assert status.backend == "mp" and status.transport is not None
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.result()["action"] == "already healthy: nothing changed"
    with contextlib.closing(mp_bed.nodes[1].engine.client()) as client:
        client.containers.get("vllm-redeploy-bed-follower").kill()
    problems = collect_status(config).problems
    assert "the vLLM follower on node-2 is not running" in problems, problems
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert state.result()["action"] == "redeployed"
    shown = subprocess.run(
        [str(CLI), "status", "-c", str(path), "--json"], capture_output=True, text=True, timeout=90
    )
    (report,) = json.loads(shown.stdout)
    assert shown.returncode == 0 and report["backend"] == "mp", report["problems"]


def test_ensure_on_mp_compares_what_mp_reads(mp_bed: TestBed) -> None:
    """On an mp group a changed [ray] port (mp never reads it) leaves the group serving; a
    changed master_port (its rendezvous) redeploys it, saying why."""
    path = cluster(mp_bed, 2, "mp-fingerprint")
    assert redeploy_vllm_cluster(str(path), return_state=True).is_completed()
    port = load_config(path, env_file=None).vllm.master_port
    cluster(mp_bed, 2, "mp-fingerprint", ray={"port": 6390})
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.result()["action"] == "already healthy: nothing changed", state.result()
    cluster(mp_bed, 2, "mp-fingerprint", ray={"port": 6390}, vllm={"master_port": port + 7})
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert state.result()["action"] == "redeployed"
    notes = " ".join(state.result()["summary"].splitlines())
    assert "the engine on node-1 runs with other settings than the configuration's" in notes


def test_a_frozen_follower_hangs_the_group_and_status_says_so(mp_bed: TestBed) -> None:
    """As on the real engine: every process of the follower stopped, the leader's next model
    step waits for it (vLLM's 300 s), /health stays 200 and the model listed; the 1-token
    generation tells, and the probe is not sent to wait out its own timeout."""
    path = cluster(mp_bed, 2, "frozen", watch={"generate_timeout_s": 2})
    assert redeploy_vllm_cluster(str(path), return_state=True).is_completed()
    config = load_config(path, env_file=None)
    with contextlib.closing(mp_bed.nodes[1].engine.client()) as client:
        freeze_container(client.containers.get("vllm-redeploy-bed-follower"))
    status = collect_status(config)
    endpoint = status.endpoint
    assert endpoint.health == 200 and endpoint.models == [config.vllm.served_name]
    assert endpoint.generation is not None and endpoint.generation.verdict == "stuck"
    assert endpoint.probe is None
    assert endpoint.generation.detail.startswith(
        "the engine hangs: a 1-token generation got no answer within 2 s and no token was "
        "processed meanwhile (1 request running, 0 waiting)"
    ), endpoint.generation
    assert endpoint.generation.detail in status.problems and len(status.problems) == 1
    shown = subprocess.run(
        [str(CLI), "status", "-c", str(path)], capture_output=True, text=True, timeout=90
    )
    assert shown.returncode == 1, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "generation stuck: the engine hangs" in text and "probe not sent" in text, text


class Together(mp_launch.MpBackend):
    """A toy third backend: vLLM's own launcher with every rank started in one step. A real
    one is its own Backend subclass (launch/backend.py), given to ``register``."""

    name = "all"
    words = "toy"

    def plan(
        self, config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None, reason: str
    ) -> LaunchPlan:
        base = mp_launch.plan(config, fabric, reason)
        labels = {LABEL_BACKEND: self.name}
        members = tuple(
            replace(m, phase=0, spec=replace(m.spec, labels={**m.spec.labels, **labels}))
            for m in base.members
        )
        return replace(base, backend=self.name, phases=(Phase("launch-group"),), members=members)


@pytest.fixture
def together() -> Iterator[Together]:
    """Registered for the test, then gone again (other tests' choices stay as they were)."""
    backend = register(Together())
    try:
        yield backend
    finally:
        BACKENDS.pop(backend.name)


def test_a_third_backend_is_an_object_given_to_register(
    mp_bed: TestBed, together: Together
) -> None:
    """Registered and named by the configuration, a plan nobody else knows is launched by the
    flow, watched by wait-ready, judged by status and ensure and printed by the dry run: none
    of them asks which backend it is."""
    path = cluster(mp_bed, 2, "together", vllm={"backend": together.name})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    steps = list(result["steps"])
    assert steps[steps.index("ports-free") + 1 :] == [
        "launch-group",
        "wait-ready",
        "transport",
        "probe",
    ]
    assert "- backend all (configured; toy)" in result["summary"]
    with contextlib.closing(mp_bed.nodes[1].engine.client()) as client:
        assert client.containers.get("vllm-redeploy-bed-follower").labels[LABEL_BACKEND] == "all"
    config = load_config(path, env_file=None)
    status = collect_status(config)
    assert status.healthy and status.backend == "all", status.problems
    with contextlib.closing(mp_bed.nodes[1].engine.client()) as client:
        client.containers.get("vllm-redeploy-bed-follower").kill()
    problems = collect_status(config).problems
    assert "the vLLM follower on node-2 is not running" in problems, problems
    lines = launch_lines(config, plan_for("all", config, why="all (configured; toy)"))
    assert lines[:2] == ["\n[launch] backend all (configured; toy)", "  step launch-group"], lines
