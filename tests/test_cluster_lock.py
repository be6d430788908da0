"""One run per cluster, and no failure that skips the clean-up (issue 13), on test beds against
the session's real Prefect server: runs of the three deployments of one cluster take turns,
two clusters run side by side, a killed holder frees the cluster after its lease, any cluster
name that passes the configuration runs, an unexpected exception ends like any failure, and a
check that could not look fails instead of passing."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

import tasks.launch
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import RAY, make_bed
from tests.test_deployments import api, deployments_by_name
from tests.testbed.bed import TestBed
from tests.testbed.procs import spawn, stop, wait_until
from vllm_redeploy.config import load_config
from vllm_redeploy.names import artifact_key, lock_name
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.nodes.containers import LABEL_MANAGED, cluster_labels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
BIN = Path(sys.executable).parent
FAST = {"VRD_LOAD_SECONDS": "1"}


@pytest.fixture(scope="module")
def lock_bed(prefect_api: str) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=41)
    yield bed
    bed.down()


@pytest.fixture(autouse=True)
def no_group_left(lock_bed: TestBed) -> Iterator[None]:
    """Tests here run clusters of several names on one bed, as on one pair of GPUs: each starts
    from no group of ours, and leaves none."""
    yield
    for node in lock_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True, filters={"label": f"{LABEL_MANAGED}"}):
                c.remove(force=True)


def ours(bed: TestBed, cluster: str) -> dict[str, list[dict[str, Any]]]:
    """Per node, this cluster's containers of ours: name, id, state, created."""
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            listed = client.containers.list(all=True, filters={"label": _labels(cluster)})
            found[node.name] = [
                {"name": c.name, "id": c.id, "status": c.status, "created": c.attrs["Created"]}
                for c in listed
            ]
    return found


def _labels(cluster: str) -> list[str]:
    return [f"{k}={v}" for k, v in cluster_labels(cluster).items()]


def flow_runs(url: str, ids: list[str]) -> list[dict[str, Any]]:
    return api(url, "POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}})


def window(run: dict[str, Any]) -> tuple[float, float]:
    return (
        datetime.fromisoformat(run["start_time"]).timestamp(),
        datetime.fromisoformat(run["end_time"]).timestamp(),
    )


def first_step_at(url: str, flow_run_id: str) -> float:
    """When the run logged its first step on the nodes (it holds the cluster from then on)."""
    logs = api(url, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}})
    stamps = [
        datetime.fromisoformat(entry["timestamp"]).timestamp()
        for entry in logs
        if entry["message"] == "step preflight"
    ]
    assert stamps, f"run {flow_run_id} never reached preflight"
    return min(stamps)


def events(url: str, name: str, resource_id: str) -> list[dict[str, Any]]:
    body = {
        "filter": {
            "event": {"name": [name]},
            "resource": {"id": [resource_id]},
            "occurred": {"since": "2020-01-01T00:00:00Z"},
        },
        "limit": 50,
    }
    return api(url, "POST", "/events/filter", body)["events"]


def failed_event(url: str, cluster: str) -> dict[str, Any]:
    """The cluster's one vllm.cluster.failed event, once the server has it."""
    deadline = time.monotonic() + 30
    while not (found := events(url, "vllm.cluster.failed", f"vllm-redeploy.cluster.{cluster}")):
        assert time.monotonic() < deadline, "no vllm.cluster.failed event"
        time.sleep(1)
    (event,) = found
    return event


# --- the three deployments of one cluster take turns ----------------------------------------


def test_nightly_after_reboot_and_manual_runs_take_turns(
    prefect_api: str, lock_bed: TestBed
) -> None:
    """All three deployments started at once, the manual one twice: they run one after another,
    each Completed, and the group left running is the last run's. No deployment has a limit of
    Prefect's own (a lease the run would have to renew through an outage): the lock is what
    serialises them."""
    cluster = f"turns{uuid.uuid4().hex[:6]}"
    path = lock_bed.write_config(lock_bed.root / "turns.toml", name=cluster, vllm={"env": FAST})
    config = load_config(path, env_file=None)
    env = {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    serve = spawn(
        [str(BIN / "vllm-redeploy"), "serve", "--config", str(path)],
        lock_bed.root / "serve.log",
        env,
    )
    try:
        names = [f"{cluster}-{kind}" for kind in ("nightly", "after-reboot", "manual")]
        wait_until(lambda: set(names) <= set(deployments_by_name(prefect_api)), 60, "serve", None)
        found = deployments_by_name(prefect_api)
        # The lock exists before any run: `serve` made it.
        limit = api(prefect_api, "GET", f"/v2/concurrency_limits/{lock_name(config.name)}")
        assert limit["limit"] == 1 and limit["active"]
        assert [found[name]["global_concurrency_limit"] for name in names] == [None] * 3
        ids = [create_run(prefect_api, found[name]["id"]) for name in [*names, names[-1]]]
        deadline = time.monotonic() + 300
        while True:
            runs = flow_runs(prefect_api, ids)
            if all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED") for r in runs):
                break
            assert time.monotonic() < deadline, [(r["name"], r["state_type"]) for r in runs]
            time.sleep(1)
    finally:
        stop(serve, grace=10)
    # Each run that did not complete says why (the serve log's tail shows only the last run).
    why = [(r["name"], (r.get("state") or {}).get("message")) for r in runs]
    assert [r["state_type"] for r in runs] == ["COMPLETED"] * 4, why
    # Each run is Running at once and waits inside for the cluster: what must not overlap is
    # from its first step on the nodes (after the lock) to its end.
    windows = sorted((first_step_at(prefect_api, r["id"]), window(r)[1]) for r in runs)
    for (_, first_end), (second_start, _) in itertools.pairwise(windows):
        assert first_end <= second_start, f"two runs of one cluster overlapped: {windows}"
    # What runs at the end was started by the last run, and nothing of an earlier run is left.
    last_start = windows[-1][0]
    for node, found_here in ours(lock_bed, cluster).items():
        assert found_here and all(c["status"] == "running" for c in found_here), (node, found_here)
        for c in found_here:
            created = datetime.fromisoformat(c["created"].split(".")[0] + "+00:00").timestamp()
            assert created >= last_start - 1, (node, c, windows)


def create_run(url: str, deployment_id: str) -> str:
    """A redeploy run of the deployment; the SQLite server answers 503 while it is busy."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return api(
                url,
                "POST",
                f"/deployments/{deployment_id}/create_flow_run",
                {"parameters": {"mode": "redeploy"}},
            )["id"]
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# --- two clusters run side by side ------------------------------------------------------------


def run_cli(path: Path, prefect_api: str, log: Path) -> subprocess.Popen[bytes]:
    env = {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return spawn([str(BIN / "vllm-redeploy"), "run", "--config", str(path)], log, env)


def latest_run(url: str, cluster: str) -> dict[str, Any]:
    """The newest flow run whose summary artifact belongs to ``cluster``."""
    found = api(
        url,
        "POST",
        "/artifacts/filter",
        {
            "artifacts": {"key": {"any_": [artifact_key(cluster, "summary")]}},
            "sort": "CREATED_DESC",
        },
    )
    return flow_runs(url, [found[0]["flow_run_id"]])[0]


@pytest.mark.slow
def test_two_clusters_run_at_the_same_time(prefect_api: str, lock_bed: TestBed) -> None:
    other = make_bed(2, "h200", first_ip=51)
    try:
        paths = [
            bed.write_config(
                bed.root / "side.toml",
                name=f"side{i}{uuid.uuid4().hex[:4]}",
                vllm={"env": {"VRD_LOAD_SECONDS": "8"}},
            )
            for i, bed in enumerate((lock_bed, other))
        ]
        procs = [run_cli(p, prefect_api, p.with_suffix(".log")) for p in paths]
        codes = [proc.wait(timeout=240) for proc in procs]
        logs = [p.with_suffix(".log").read_text()[-2000:] for p in paths]
        assert codes == [0, 0], logs
        runs = [latest_run(prefect_api, load_config(p, env_file=None).name) for p in paths]
        (start_a, end_a), (start_b, end_b) = (window(r) for r in runs)
        assert start_a < end_b and start_b < end_a, "two clusters' runs took turns"
    finally:
        other.down()


# --- a holder that dies --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_holder_frees_the_cluster_after_its_lease(
    prefect_api: str, lock_bed: TestBed
) -> None:
    """The controller running a redeploy is killed mid-load: its lease stops being renewed and
    the next run proceeds once the server frees it (lease_s after the last renewal)."""
    cluster = f"killed{uuid.uuid4().hex[:6]}"
    lease_s = 60  # Prefect's minimum
    path = lock_bed.write_config(
        lock_bed.root / "killed.toml",
        name=cluster,
        vllm={"env": {"VRD_LOAD_SECONDS": "120"}, **RAY},  # it waits for Ray's step
        lock={"lease_s": lease_s, "wait_s": 600},
    )
    log = lock_bed.root / "killed.log"
    proc = run_cli(path, prefect_api, log)
    try:
        name = lock_name(cluster)
        wait_until(
            lambda: _active(prefect_api, name) == 1 and "step launch-vllm" in log.read_text(),
            120,
            "the first run holding the cluster and loading",
            log,
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies: no release, no teardown
        proc.wait(10)
    killed_at = time.monotonic()
    again = lock_bed.write_config(
        lock_bed.root / "again.toml",
        name=cluster,
        vllm={"env": FAST, **RAY},
        lock={"lease_s": lease_s, "wait_s": 600},
    )
    state = redeploy_vllm_cluster(str(again), "redeploy", return_state=True)
    took = time.monotonic() - killed_at
    assert state.is_completed(), state.result(raise_on_failure=False)
    steps = state.result()["steps"]
    # It waited for the lease to run out (renewed every 45 s, so up to 60 s left), then served.
    assert steps["cluster-lock"] >= 10, steps
    assert took < lease_s + 120, took
    assert _active(prefect_api, lock_name(cluster)) == 0  # released at its end


def _active(url: str, name: str) -> int:
    try:
        return int(api(url, "GET", f"/v2/concurrency_limits/{name}")["active_slots"])
    except httpx.HTTPStatusError:
        return 0


# --- names, unexpected exceptions, checks that could not look ------------------------------------


def test_a_cluster_name_with_capitals_underscores_and_dots_runs(
    prefect_api: str, lock_bed: TestBed
) -> None:
    cluster = "Bed_A.v2"
    path = lock_bed.write_config(
        lock_bed.root / "named.toml", name=cluster, vllm={"env": FAST, **RAY}
    )
    state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    keys = {
        a["key"]
        for a in api(
            prefect_api,
            "POST",
            "/artifacts/filter",
            {"artifacts": {"flow_run_id": {"any_": [str(state.state_details.flow_run_id)]}}},
        )
        if a.get("key")
    }
    assert {artifact_key(cluster, "summary"), artifact_key(cluster, "load")} <= keys
    assert artifact_key(cluster, "summary").startswith("bed-a-v2-")
    running = {c["name"] for node in ours(lock_bed, cluster).values() for c in node}
    assert {"vllm-redeploy-Bed_A.v2-ray", "vllm-redeploy-Bed_A.v2-engine"} <= running


def test_an_unexpected_exception_ends_like_any_failure(
    prefect_api: str, lock_bed: TestBed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a step (injected here: rendering a launch command raises once the Ray head's
    container is started) fails the run with the step named, writes the diagnostics and the
    summary, emits vllm.cluster.failed, and removes the half-started group."""
    cluster = f"bug{uuid.uuid4().hex[:6]}"
    path = lock_bed.write_config(
        lock_bed.root / "bug.toml", name=cluster, vllm={"env": FAST, **RAY}
    )

    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("injected: the launch command cannot be rendered")

    monkeypatch.setattr(tasks.launch, "render_command", broken)
    state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert message.startswith("ray-head: unexpected error in ray-head: RuntimeError: ")
    assert "injected: the launch command cannot be rendered" in message
    assert "Traceback" not in message
    run_id = str(state.state_details.flow_run_id)
    keys = {
        a["key"]
        for a in api(
            prefect_api,
            "POST",
            "/artifacts/filter",
            {"artifacts": {"flow_run_id": {"any_": [run_id]}}},
        )
        if a.get("key")
    }
    assert {artifact_key(cluster, "diagnostics"), artifact_key(cluster, "summary")} <= keys
    assert all(not found for found in ours(lock_bed, cluster).values()), ours(lock_bed, cluster)
    event = failed_event(prefect_api, cluster)
    assert event["payload"]["step"] == "ray-head"
    assert event["payload"]["reason"].startswith("unexpected error in ray-head: RuntimeError")
    labels = {k: v for k, v in event["resource"].items()}
    assert labels["vllm-redeploy.cluster"] == cluster
    # and the traceback went to the flow run's log, for whoever debugs it
    logs = api(prefect_api, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}})
    assert any(
        "Traceback" in entry["message"] and "RuntimeError" in entry["message"] for entry in logs
    )


def test_a_run_stopped_from_outside_ends_like_any_failure(
    prefect_api: str, lock_bed: TestBed
) -> None:
    """SIGTERM to the run's process during the load (Prefect turns it into a BaseException in
    the flow, as it does a cancellation): diagnostics, the summary, vllm.cluster.failed, and the
    half-started group removed, as for any failure."""
    cluster = f"term{uuid.uuid4().hex[:6]}"
    path = lock_bed.write_config(
        lock_bed.root / "term.toml", name=cluster, vllm={"env": {"VRD_LOAD_SECONDS": "120"}}
    )
    log = lock_bed.root / "term.log"
    run = run_cli(path, prefect_api, log)
    wait_until(lambda: "step wait-ready" in log.read_text(), 120, "the load", log)
    assert all(ours(lock_bed, cluster).values())  # the group is up, loading
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) != 0
    assert all(not found for found in ours(lock_bed, cluster).values()), log.read_text()[-3000:]
    event = failed_event(prefect_api, cluster)
    assert event["payload"]["step"] == "wait-ready"
    assert event["payload"]["reason"].startswith("the run was stopped from outside during wait")
    written = api(
        prefect_api,
        "POST",
        "/artifacts/filter",
        {
            "artifacts": {
                "key": {"any_": [artifact_key(cluster, k) for k in ("summary", "diagnostics")]}
            }
        },
    )
    assert {a["key"] for a in written} == {
        artifact_key(cluster, "summary"),
        artifact_key(cluster, "diagnostics"),
    }


def test_a_port_check_that_cannot_run_fails_the_step(prefect_api: str, lock_bed: TestBed) -> None:
    """`ss` missing on the head: the run says it could not check, instead of "free"; preflight
    reads the head's ports first (issue 50), so it fails there, before anything stops."""
    head = lock_bed.nodes[0]
    missing = head.bin_dir / "ss"
    missing.write_text('#!/bin/sh\necho "sh: 1: ss: not found" >&2\nexit 127\n')
    missing.chmod(0o755)
    try:
        path = lock_bed.write_config(lock_bed.root / "noss.toml", vllm={"env": FAST})
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    finally:
        missing.unlink()
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert message.startswith(
        f"preflight: could not check the head's ports on {head.name}: `ss` exited with "
        "code 127 (sh: 1: ss: not found)"
    ), message
    assert all(not found for found in ours(lock_bed, "bed").values())


def test_a_gpu_check_that_cannot_run_fails_before_anything_stops(
    prefect_api: str, lock_bed: TestBed
) -> None:
    """nvidia-smi is read in preflight (issue 50): a driver that does not answer is found
    there, in nvidia-smi's words, before the old stack is stopped."""
    worker = lock_bed.nodes[1]
    broken = worker.bin_dir / "nvidia-smi.real"
    (worker.bin_dir / "nvidia-smi").rename(broken)
    smi = worker.bin_dir / "nvidia-smi"
    smi.write_text(  # what nvidia-smi prints when the driver is not loaded
        "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
        'driver. Make sure that the latest NVIDIA driver is installed and running."\nexit 9\n'
    )
    smi.chmod(0o755)
    try:
        path = lock_bed.write_config(lock_bed.root / "nosmi.toml", vllm={"env": FAST})
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    finally:
        broken.replace(smi)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and message.startswith("preflight: "), message
    assert (
        f"{worker.name}: nvidia-smi failed (exit code 9: NVIDIA-SMI has failed because it "
        "couldn't communicate with the NVIDIA driver."
    ) in message
    assert "nothing was stopped" in message


def test_the_status_and_ensure_agree(prefect_api: str, lock_bed: TestBed) -> None:
    """One judgement: after the worker's Ray container dies, `status` names it and `ensure`
    redeploys for the same reason."""
    path = lock_bed.write_config(lock_bed.root / "agree.toml", vllm={"env": FAST, **RAY})
    assert redeploy_vllm_cluster(str(path), "redeploy", return_state=True).is_completed()
    config = load_config(path, env_file=None)
    with NodeAccess(config.nodes[1], config) as worker:
        worker.docker.remove(f"vllm-redeploy-{config.name}-ray")
    from vllm_redeploy.status import collect_status

    gone = f"the Ray container on {config.nodes[1].name} is not running"
    assert gone in collect_status(config).problems
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.is_completed()
    notes = state.result()["notes"]
    assert notes[0].startswith("redeploying: ") and gone in notes[0], notes
