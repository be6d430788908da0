"""Hands off when told (issue 49), on a bed against the session's real Prefect server: a pause
taken while runs wait for the cluster, sleep a recovery's backoff, or work, stops each of them
before its next change, and `pause` says what each will do."""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from flows.redeploy import redeploy_vllm_cluster
from tasks.context import Run, StepFailed
from tasks.standing.lock import Record, cluster_lock
from tasks.stop_autostart import stop_autostart
from tasks.teardown import teardown_group
from tests.conftest import keep_for_notes, make_bed
from tests.test_cluster_lock import events, run_cli
from tests.test_deployments import api
from tests.test_lock_holder import _now, a_flow_run
from tests.test_recovery import Controller
from tests.testbed.bed import TestBed
from tests.testbed.image import OLD_STACK_IMAGE, OLD_STACK_UNIT
from tests.testbed.procs import spawn, wait_until
from vllm_redeploy.config import load_config
from vllm_redeploy.names import cluster_tag, deployment_name
from vllm_redeploy.nodes.containers import LABEL_MANAGED, cluster_labels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
BIN = Path(sys.executable).parent
REASON = "investigating the flapping"


@pytest.fixture(scope="module")
def bed(prefect_api: str) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=225)
    yield bed
    bed.down()


@pytest.fixture(autouse=True)
def no_group_left(bed: TestBed) -> Iterator[None]:
    """Each test starts from no group of ours on the bed's GPUs, and leaves none."""
    yield
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True, filters={"label": LABEL_MANAGED}):
                c.remove(force=True)


def cli(prefect_api: str, path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PREFECT_API_URL": prefect_api, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(BIN / "vllm-redeploy"), *args, "--config", str(path)],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip


def pause(prefect_api: str, path: Path) -> list[str]:
    done = cli(prefect_api, path, "pause", "--reason", REASON)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def ours(bed: TestBed, cluster: str) -> dict[str, list[str]]:
    """Per node, the ids of this cluster's containers of ours."""
    labels = [f"{k}={v}" for k, v in cluster_labels(cluster).items()]
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            listed = client.containers.list(all=True, filters={"label": labels})
            found[node.name] = sorted(c.id for c in listed)
    return found


def runs_of(prefect_api: str, cluster: str) -> list[dict[str, Any]]:
    body = {"flow_runs": {"tags": {"all_": [cluster_tag(cluster)]}}, "sort": "START_TIME_ASC"}
    return api(prefect_api, "POST", "/flow_runs/filter", body)


def test_a_run_waiting_for_the_cluster_when_it_is_paused_changes_nothing(
    prefect_api: str, bed: TestBed
) -> None:
    """H holds the cluster through a load; W waits for it; a person pauses. `pause` names both
    and what each does; H, past its last change, serves; W gets the cluster, changes nothing and
    ends Skipped naming the pause."""
    cluster = f"waited{uuid.uuid4().hex[:6]}"
    path = bed.write_config(
        bed.root / "waited.toml", name=cluster, vllm={"env": {"VRD_LOAD_SECONDS": "40"}}
    )
    log_h, log_w = bed.root / "holder.log", bed.root / "waiter.log"
    holder = run_cli(path, prefect_api, log_h)
    waiter = None
    try:
        # W starts once H holds the cluster, not once H loads: on a busy machine W's start took
        # long enough that H had served and W, given the cluster, had ended before the pause.
        wait_until(lambda: "step preflight" in log_h.read_text(), 120, "H holding", log_h)
        waiter = run_cli(path, prefect_api, log_w)
        wait_until(lambda: "step cluster-lock" in log_w.read_text(), 60, "W waiting", log_w)
        wait_until(lambda: "step wait-ready" in log_h.read_text(), 120, "H loading", log_h)
        wait_until(lambda: len(runs_of(prefect_api, cluster)) == 2, 30, "both runs tagged")
        h, w = runs_of(prefect_api, cluster)
        said = pause(prefect_api, path)
        keep_for_notes("pause-with-runs", "\n".join(said) + "\n")
        assert said[0].startswith(f"{cluster}: paused by ") and said[0].endswith(REASON), said
        assert said[1:] == [
            f"  flow run {h['name']} (manual) holds the cluster: finishes the step it is in, "
            "then changes nothing more (Cancelled, the nodes left as they are; Skipped if it "
            "changed nothing yet)",
            f"  flow run {w['name']} (manual) waits: ends Skipped when it gets the cluster, "
            "changing nothing",
        ], said
        assert holder.wait(timeout=120) == 0, log_h.read_text()[-3000:]
        served = ours(bed, cluster)
        assert all(served.values()), served
        # Skipped: nothing was done, which `run` says and a script reads (exit 1)
        assert waiter.wait(timeout=60) == 1, log_w.read_text()[-3000:]
        assert f"{cluster}: nothing was done (skipped: paused by " in log_w.read_text()
    finally:
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
        cli(prefect_api, path, "resume")
    (w_end,) = [r for r in runs_of(prefect_api, cluster) if r["id"] == w["id"]]
    assert w_end["state_name"] == "Skipped", w_end["state"]
    assert REASON in w_end["state"]["message"] and "paused by " in w_end["state"]["message"]
    text = log_w.read_text()
    assert "step preflight" not in text and "step stop-autostart" not in text, text[-3000:]
    assert ours(bed, cluster) == served  # W started, stopped and removed nothing


def test_a_holder_paused_mid_run_stops_before_its_next_change(
    prefect_api: str, bed: TestBed
) -> None:
    """H waits in gpus-clear for a stray process; a person pauses; the process goes: H makes no
    further change, tears nothing down, reports no failure, and ends Cancelled naming the step it
    did not start and the pause."""
    cluster = f"midrun{uuid.uuid4().hex[:6]}"
    path = bed.write_config(
        bed.root / "midrun.toml",
        name=cluster,
        vllm={"env": {"VRD_LOAD_SECONDS": "1"}},
        deadlines={"gpu_release_s": 90},
    )
    log = bed.root / "midrun.log"
    stray = bed.nodes[1].hold_gpu(20998, "python3")
    proc = run_cli(path, prefect_api, log)
    try:
        wait_until(lambda: "step gpus-clear" in log.read_text(), 120, "H in gpus-clear", log)
        said = pause(prefect_api, path)
        assert len(said) == 2 and " holds the cluster: finishes the step it is in" in said[1]
        stray.kill()
        assert proc.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        for p in (stray, proc):
            if p.poll() is None:
                p.kill()
        cli(prefect_api, path, "resume")
    text = log.read_text()
    assert "cancelled: stopped before memory, leaving the nodes as they are: paused by " in text
    assert "step memory" not in text and "step launch" not in text, text[-3000:]
    (run,) = runs_of(prefect_api, cluster)
    assert run["state_type"] == "CANCELLED", run["state"]
    assert run["state"]["message"].startswith("stopped before memory, leaving the nodes as they")
    assert REASON in run["state"]["message"]
    assert ours(bed, cluster) == {n.name: [] for n in bed.nodes}  # nothing started, none removed
    assert not events(prefect_api, "vllm.cluster.failed", f"vllm-redeploy.cluster.{cluster}")


def said_by(prefect_api: str, flow_run_id: str, words: str) -> bool:
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}}
    return any(
        words in entry["message"] for entry in api(prefect_api, "POST", "/logs/filter", body)
    )


def past_recovery(prefect_api: str, cluster: str) -> None:
    """A recovery of the cluster that acted and failed just now, in Prefect's own history (what
    the guard counts): a run of the ``<cluster>-recover`` deployment, Running then Failed."""
    flow = api(prefect_api, "POST", "/flows/", {"name": "redeploy-vllm-cluster"})
    tags = ["vllm-redeploy", cluster_tag(cluster), "recover"]  # as deployments/definitions.py
    body = {"name": deployment_name(cluster, "recover"), "flow_id": flow["id"], "tags": tags}
    deployment = api(prefect_api, "POST", "/deployments/", body)
    run = api(prefect_api, "POST", f"/deployments/{deployment['id']}/create_flow_run", {})
    for state in ({"type": "RUNNING"}, {"type": "FAILED", "message": "wait-ready: it died"}):
        api(prefect_api, "POST", f"/flow_runs/{run['id']}/set_state", {"state": state})


def test_a_recovery_asleep_in_its_backoff_when_it_is_paused_changes_nothing(
    prefect_api: str, bed: TestBed
) -> None:
    cluster = f"backoff{uuid.uuid4().hex[:6]}"
    path = bed.write_config(
        bed.root / "backoff.toml", name=cluster, watch={"backoff_s": 20, "max_recoveries": 3}
    )
    past_recovery(prefect_api, cluster)
    found: dict[str, Any] = {}
    recovery = threading.Thread(  # in this context: its settings name the session's server
        target=contextvars.copy_context().run,
        args=(
            lambda: found.update(
                state=redeploy_vllm_cluster(
                    str(path), "ensure", trigger="recover", return_state=True
                )
            ),
        ),
    )
    recovery.start()
    wait_until(lambda: len(runs_of(prefect_api, cluster)) == 2, 30, "the recovery tagged")
    this = runs_of(prefect_api, cluster)[-1]["id"]
    wait_until(lambda: said_by(prefect_api, this, "in the window: waiting"), 30, "its backoff")
    said = pause(prefect_api, path)
    recovery.join(timeout=120)
    cli(prefect_api, path, "resume")
    assert said[1].endswith("(recover) waits: ends Skipped when it gets the cluster, changing "
                            "nothing"), said  # fmt: skip
    state = found["state"]
    assert state.name == "Skipped", state
    assert REASON in (state.message or "") and "paused by " in (state.message or "")
    steps = state.result()["steps"]
    assert steps["guard"] >= 15, steps  # it slept its backoff, then read the pause again
    assert "preflight" not in steps and "inspect" not in steps, steps


@flow
def lose_the_cluster_then(path: str, step: str) -> None:
    """Take the cluster, lose it to another run (as a holder paused past its lease finds on
    resuming), then go on with ``step``, as the step in flight would."""
    config = load_config(path, env_file=None)
    run = Run(config)
    with cluster_lock(config) as hold:
        run.hold_check = hold.confirm
        Record(a_flow_run(), "next-holder", beat=_now()).write(config.name)
        try:
            if step == "stop-autostart":
                stop_autostart.fn(run, "node-2")
            else:
                teardown_group(run)
        finally:
            run.close()


def test_a_run_that_lost_the_cluster_touches_nothing_the_next_holder_started(
    prefect_api: str, bed: TestBed
) -> None:
    """Every call that changes a node confirms the hold right before it: the step in flight of
    a run that lost the cluster stops no unit and removes no container (the next holder's own
    among them), and its tear-down leaves the group to the run that took it."""
    cluster = f"lost{uuid.uuid4().hex[:6]}"
    path = bed.write_config(bed.root / "lost.toml", name=cluster)
    worker = bed.nodes[1]
    for node in bed.nodes:  # the old stack back, as after a reboot (earlier runs stopped it)
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True, filters={"name": "glm-proxy"}):
                c.remove(force=True)
    bed.install_old_stack()
    labels = {**cluster_labels(cluster), LABEL_MANAGED: "true"}
    with contextlib.closing(worker.engine.client()) as client:
        client.containers.run(
            OLD_STACK_IMAGE, ["sleep", "600"], name=f"{cluster}-next", labels=labels, detach=True
        )
    before = worker.running()
    assert {f"{cluster}-next", "glm-server", "glm-proxy"} <= before, before
    for step in ("stop-autostart", "teardown"):
        with pytest.raises(StepFailed, match=r"another run took .*\(flow run next-holder"):
            lose_the_cluster_then(str(path), step)
        Record(a_flow_run("COMPLETED"), "next-holder", beat=_now()).write(cluster)  # it ended
    assert worker.running() == before


# The worker's glm-server.service (the one unit the bed's sudoers lets the login stop), made a
# unit whose stop takes 30 s (its ExecStop=): a run stopping it stays inside stop-autostart.
SLOW_STOP_UNIT = """[Unit]
Description=a previous stack whose stop takes 30 s

[Service]
ExecStart=/bin/sleep 999999
ExecStop=/bin/sleep 30

[Install]
WantedBy=multi-user.target
"""


def container_events(node: Any, since: float, cluster: str) -> list[tuple[float, str, str]]:
    """(time, action, name) of each event of this cluster's containers on ``node`` since then."""
    prefix = f"vllm-redeploy-{cluster}-"
    with contextlib.closing(node.engine.client()) as client:
        stream = client.events(
            since=int(since), until=int(time.time()) + 1, decode=True, filters={"type": "container"}
        )
        found = [
            (e["timeNano"] / 1e9, e["Action"], e["Actor"]["Attributes"].get("name", ""))
            for e in stream
        ]
    return [e for e in found if e[2].startswith(prefix)]


def test_a_holder_stopped_inside_stop_autostart_removes_nothing_of_the_run_that_took_over(
    prefect_api: str, bed: TestBed
) -> None:
    """Holder A is stopped (SIGSTOP: a VM pause, swap) while the worker's unit takes 30 s to
    stop; past its lease B takes the cluster and launches; A is resumed. A's step in flight
    goes on from where it was, so its next call would remove what it listed: it confirms its
    hold first, finds B's, and stops. Docker's own events show no kill or removal of B's
    containers; B serves; A fails naming B."""
    cluster = f"sigstop{uuid.uuid4().hex[:6]}"
    worker = bed.nodes[1]
    worker.systemctl("stop", OLD_STACK_UNIT)
    worker.write_file(f"/etc/systemd/system/{OLD_STACK_UNIT}", SLOW_STOP_UNIT)
    assert worker.systemctl("daemon-reload").returncode == 0
    assert worker.systemctl("start", OLD_STACK_UNIT).returncode == 0
    path = bed.write_config(
        bed.root / "sigstop.toml",
        name=cluster,
        vllm={"env": {"VRD_LOAD_SECONDS": "1"}},
        lock={"lease_s": 60},
    )
    since = time.time()
    a = run_cli(path, prefect_api, bed.root / "sigstop-a.log")
    b: subprocess.Popen[bytes] | None = None
    try:
        wait_until(
            lambda: worker.systemctl("is-active", OLD_STACK_UNIT).stdout.strip() == "deactivating",
            120,
            "A stopping the slow unit",
            bed.root / "sigstop-a.log",
        )
        os.killpg(a.pid, signal.SIGSTOP)
        b = run_cli(path, prefect_api, bed.root / "sigstop-b.log")
        wait_until(
            lambda: "step wait-ready" in (bed.root / "sigstop-b.log").read_text(),
            180,
            "B holding the cluster past A's lease, and launching",
            bed.root / "sigstop-b.log",
        )
        assert container_events(worker, since, cluster), "B started nothing on the worker"
        os.killpg(a.pid, signal.SIGCONT)
        assert b.wait(timeout=120) == 0, (bed.root / "sigstop-b.log").read_text()[-3000:]
        assert a.wait(timeout=120) == 1, (bed.root / "sigstop-a.log").read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        worker.systemctl("stop", OLD_STACK_UNIT)
        worker.define_unit(OLD_STACK_UNIT, "glm-server", OLD_STACK_IMAGE, ["sleep", "999999"])
    events = container_events(worker, since, cluster)
    created = min(t for t, action, _ in events if action == "create")
    undone = [e for e in events if e[0] >= created and e[1] in ("kill", "destroy")]
    assert not undone, events
    done = {r["state_type"]: r for r in runs_of(prefect_api, cluster)}
    assert set(done) == {"COMPLETED", "FAILED"}, done
    said = (bed.root / "sigstop-a.log").read_text()
    assert f"another run took {cluster} while this one could not renew its hold" in said, said
    assert f"(flow run {done['COMPLETED']['name']}" in said, said
    assert ours(bed, cluster)[worker.name], "B's group is not on the worker"


def test_a_run_on_a_clock_200_s_behind_is_not_taken_for_gone_by_the_watcher(
    prefect_api: str, bed: TestBed
) -> None:
    """A manual run from a machine whose clock is 200 s behind (libfaketime), while `serve`
    and `watch` run on the real clock: its beats read 200 s old by any other clock, older
    than lease_s + 30 s. The watcher asks the Prefect server's clock, counts the cluster busy
    through the load, and starts no recovery."""
    cluster = f"behind{uuid.uuid4().hex[:6]}"
    ctl = Controller(bed, bed.root / "behind.toml", cluster, prefect_api, {})
    ctl.write(VRD_LOAD_SECONDS="20")  # the watcher looks every second: 20 looks in the load
    state = redeploy_vllm_cluster(str(ctl.path), "redeploy", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    log = bed.root / "behind.log"
    try:
        ctl.start()
        env = {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        argv = ["faketime", "-f", "-200s", str(BIN / "vllm-redeploy"), "run", "-c", str(ctl.path)]
        assert spawn(argv, log, env).wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        ctl.stop()
    record = Record.read(cluster)
    assert record is not None and record.released
    behind_s = (datetime.now(UTC) - datetime.fromisoformat(record.beat)).total_seconds()
    assert behind_s > 190, record  # its clock was behind, as the record it wrote says
    assert not ctl.events("vllm.cluster.unhealthy"), (bed.root / "watch.log").read_text()
    logs = "\n".join(
        p.read_text()[-4000:] for p in (bed.root / "watch.log", bed.root / "serve.log")
    )
    assert ctl.runs("recover") == [], logs
