"""The controller's bad minutes never cost a load (issue 48), on the bed against a Prefect server
of the test's own, stopped and started again on its port and database:

- a restart: away 45 s while run A loads, the watcher looking, run B due (issue 34);
- away 90 s while the weights load (a progress write due inside), and again from the transport
  step on, so the probe passes and the summary is due while it is away;
- away 4 minutes from the load's start past its end, for `serve`'s deployment runs;
- the holder's process stopped (SIGSTOP) for 150 s during the load while a run B waits;
- a 500 (no retry in Prefect's client) to the summary's write, through a proxy in front of the
  real server (tests/testbed/flaky_api.py).

Each run completes with the model served, and the group it started is the one left running.

Each scenario is minutes of waiting (an outage is played out in full), so they are played side by
side, each on its own bed and server, when the module starts (``played``); each test then waits
for its own and says what went wrong. One after another they would cost a worker ~18 minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from docker.models.containers import Container

from tests.conftest import keep_for_notes, make_bed
from tests.test_deployments import deployments_by_name
from tests.testbed.bed import TestBed
from tests.testbed.flaky_api import flaky_api
from tests.testbed.prefect_server import FILE_LEASES, PrefectServer, at, cli, step_started
from tests.testbed.procs import stop, wait_until
from vllm_redeploy.names import artifact_key
from vllm_redeploy.nodes.containers import LABEL_MANAGED

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]
# The bed's 120 s would end a long load that shares two cores with the other scenarios.
LOAD_DEADLINE = {"model_load_s": 600}


@contextmanager
def own_server(home: Path, env: dict[str, str] | None = None) -> Iterator[PrefectServer]:
    home.mkdir()
    server = PrefectServer(home, env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


Scenario = Callable[[Path, str], None]  # (its own directory, the session's Prefect API)


def on_own_server(
    body: Callable[[PrefectServer, Path], None], env: dict[str, str] | None = None
) -> Scenario:
    def play(tmp_path: Path, _: str) -> None:
        with own_server(tmp_path / "prefect-home", env) as server:
            body(server, tmp_path)

    return play


def managed(bed: TestBed, stopped_too: bool = False) -> dict[str, Container]:
    """Every node's containers of ours, by "node/name"."""
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=stopped_too, filters={"label": LABEL_MANAGED}):
                found[f"{node.name}/{c.name}"] = c
    return found


def group(bed: TestBed) -> dict[str, str]:
    """The running group, name → id: the group a run started."""
    return {name: c.id for name, c in managed(bed).items()}


def said(log: Path, text: str) -> bool:
    return text in log.read_text(errors="replace")


def away(server: PrefectServer, seconds: float) -> None:
    server.stop()
    time.sleep(seconds)
    server.start()


def summary_of(server: PrefectServer, cluster: str) -> list[dict[str, Any]]:
    return server.post(
        "/artifacts/filter",
        {"artifacts": {"key": {"any_": [artifact_key(cluster, "summary")]}}},
    )


def manual_run_loading(server: PrefectServer, cluster: str, serve_log: Path) -> dict[str, Any]:
    """A redeploy run of the cluster's manual deployment (served by `serve`), once it loads."""
    manual = f"{cluster}-manual"
    wait_until(lambda: manual in deployments_by_name(server.url), 90, "serve", serve_log)
    deployment = deployments_by_name(server.url)[manual]
    flow_run = server.post(
        f"/deployments/{deployment['id']}/create_flow_run", {"parameters": {"mode": "redeploy"}}
    )

    def loading() -> bool:
        return step_started(server, flow_run["id"], "wait-ready") is not None

    wait_until(loading, 240, "the deployment run's load", serve_log)
    return flow_run


def away_90_s_twice(server: PrefectServer, tmp_path: Path) -> None:
    bed = make_bed(2, "h200", first_ip=131)
    try:
        cluster = f"away{uuid.uuid4().hex[:6]}"
        path = bed.write_config(
            tmp_path / "c.toml",
            name=cluster,
            vllm={"env": {"VRD_LOAD_SECONDS": "110", "VRD_SHARDS": "30"}},
            deadlines=LOAD_DEADLINE,
        )
        log = tmp_path / "run.log"
        run = cli("run", path, server.url, log)
        wait_until(lambda: said(log, "step wait-ready"), 180, "the load", log)
        time.sleep(10)  # progress written; the next is due inside the outage
        loading = group(bed)
        away(server, 90)
        wait_until(lambda: said(log, "step transport"), 180, "the load's end", log)
        away(server, 90)  # the probe passes and the summary is due while it is away
        assert run.wait(timeout=400) == 0, log.read_text()[-3000:]

        (flow_run,) = server.post("/flow_runs/filter", {})
        assert flow_run["state_type"] == "COMPLETED", flow_run
        assert group(bed) == loading  # served by the group it loaded, nothing torn down
        assert summary_of(server, cluster), "the summary was never recorded"
        text = log.read_text()
        assert "did not take this run's records" in text, text[-3000:]
        assert "answers again" in text
    finally:
        bed.down()


def away_4_minutes(server: PrefectServer, tmp_path: Path, first_ip: int) -> None:
    bed = make_bed(2, "h200", first_ip=first_ip)
    serve = None
    try:
        cluster = f"long{uuid.uuid4().hex[:6]}"
        path = bed.write_config(
            tmp_path / "c.toml",
            name=cluster,
            vllm={"env": {"VRD_LOAD_SECONDS": "120", "VRD_SHARDS": "30"}},
            deadlines=LOAD_DEADLINE,
        )
        serve = cli("serve", path, server.url, tmp_path / "serve.log")
        flow_run = manual_run_loading(server, cluster, tmp_path / "serve.log")
        time.sleep(10)
        loading = group(bed)
        away(server, 240)  # past the load's end, the probe and the summary's write

        deadline = time.monotonic() + 420
        state = None
        while time.monotonic() < deadline:
            state = server.get(f"/flow_runs/{flow_run['id']}")["state_type"]
            if state in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            time.sleep(2)
        serve_log = (tmp_path / "serve.log").read_text(errors="replace")
        assert state == "COMPLETED", serve_log[-4000:]
        assert group(bed) == loading
        assert summary_of(server, cluster), "the summary was never recorded"
        assert "lease renewal failed" not in serve_log
    finally:
        if serve is not None:
            stop(serve, grace=10)
        bed.down()


def flow_run_process(serve: subprocess.Popen[bytes], flow_run_id: str) -> int:
    """The pid of the process `serve` started for the flow run (it names the run in its
    environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ.split(b"\0"):
            return int(entry.name)
    raise AssertionError(f"no process runs flow run {flow_run_id} (serve pid {serve.pid})")


def holder_stopped_150_s(server: PrefectServer, tmp_path: Path) -> None:
    bed = make_bed(2, "h200", first_ip=135)
    serve = None
    try:
        cluster = f"stop{uuid.uuid4().hex[:6]}"
        lock = {"lease_s": 240, "wait_s": 900}
        path_a = bed.write_config(
            tmp_path / "a.toml",
            name=cluster,
            vllm={"env": {"VRD_LOAD_SECONDS": "60"}},
            deadlines=LOAD_DEADLINE,
            lock=lock,
        )
        path_b = bed.write_config(
            tmp_path / "b.toml", name=cluster, vllm={"env": {"VRD_LOAD_SECONDS": "1"}}, lock=lock
        )
        serve = cli("serve", path_a, server.url, tmp_path / "serve.log")
        a = manual_run_loading(server, cluster, tmp_path / "serve.log")
        pid = flow_run_process(serve, a["id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            log_b = tmp_path / "b.log"
            run_b = cli("run", path_b, server.url, log_b)
            time.sleep(150)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert run_b.wait(timeout=400) == 0, log_b.read_text()[-3000:]

        found = {r["id"]: r for r in server.post("/flow_runs/filter", {})}
        deadline = time.monotonic() + 60
        while found[a["id"]]["state_type"] not in ("COMPLETED", "FAILED"):
            assert time.monotonic() < deadline, found[a["id"]]
            time.sleep(2)
            found = {r["id"]: r for r in server.post("/flow_runs/filter", {})}
        (b,) = [r for r in found.values() if r["deployment_id"] is None]  # not the nightly's
        assert found[a["id"]]["state_type"] == "COMPLETED", (tmp_path / "serve.log").read_text()
        b_changes = step_started(server, b["id"], "stop-autostart")
        assert b_changes is not None and b_changes > at(found[a["id"]]["end_time"]), (
            "run B touched the nodes while run A held the cluster"
        )
    finally:
        if serve is not None:
            stop(serve, grace=10)
        bed.down()


def a_500_to_the_summary_write(tmp_path: Path, prefect_api: str) -> None:
    bed = make_bed(2, "h200", first_ip=137)
    cluster = f"err{uuid.uuid4().hex[:6]}"
    summary_key = artifact_key(cluster, "summary")
    once: list[str] = []

    def cue(method: str, path: str, body: object) -> bool:
        summary = isinstance(body, dict) and body.get("key") == summary_key
        if method == "POST" and path.rstrip("/") == "/artifacts" and summary and not once:
            once.append(path)
            return True
        return False

    try:
        path = bed.write_config(tmp_path / "c.toml", name=cluster)
        log = tmp_path / "run.log"
        with flaky_api(prefect_api, cue) as api:
            run = cli("run", path, api.url, log)
            assert run.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert api.failed == ["POST /artifacts/"], api.failed
        text = log.read_text()
        assert "did not take this run's records" in text and "500" in text, text[-3000:]
        served = group(bed)
        assert served and all(running(bed).values()), served  # not torn down
        written = httpx.post(
            f"{prefect_api}/artifacts/filter",
            json={"artifacts": {"key": {"any_": [summary_key]}}},
            timeout=30,
        ).json()
        assert len(written) == 1, written  # written once the API took it
    finally:
        bed.down()


def running(bed: TestBed) -> dict[str, bool]:
    return {name: c.status == "running" for name, c in managed(bed, stopped_too=True).items()}


def engine_ids(bed: TestBed) -> dict[str, str]:
    with contextlib.closing(bed.nodes[0].engine.client()) as client:
        return {c.name: c.id for c in client.containers.list(filters={"label": LABEL_MANAGED})}


def restart_45_s_with_a_run_due(server: PrefectServer, tmp_path: Path) -> None:
    """Run A is loading, the watcher looks every few seconds, the server is down for 45 s and
    comes back on the same database, and run B of the same cluster is due: A's load completes,
    nothing touches A's group while A runs, and B starts within seconds of A's end (instead of
    waiting out `[lock] wait_s` for a slot whose lease the server forgot)."""
    bed = make_bed(2, "h200", first_ip=107)
    watcher: subprocess.Popen[bytes] | None = None
    try:
        cluster = f"outage{uuid.uuid4().hex[:6]}"
        load_s = 75
        first = bed.write_config(
            tmp_path / "a.toml",
            name=cluster,
            vllm={"env": {"VRD_LOAD_SECONDS": str(load_s)}},
            deadlines=LOAD_DEADLINE,
            lock={"lease_s": 60, "wait_s": 240},
            watch={"interval_s": 3, "failures": 2},
        )
        second = bed.write_config(
            tmp_path / "b.toml",
            name=cluster,
            vllm={"env": {"VRD_LOAD_SECONDS": "1"}},
            lock={"lease_s": 60, "wait_s": 240},
        )
        log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
        run_a = cli("run", first, server.url, log_a)
        wait_until(lambda: "step wait-ready" in log_a.read_text(), 180, "run A loading", log_a)
        # From A's load on: before A holds the cluster, there is nothing to serve, rightly
        # reported by a watcher (a recovery would then wait for A).
        watcher = cli("watch", first, server.url, tmp_path / "watch.log")
        loading = engine_ids(bed)

        server.stop()
        down_at = time.time()
        time.sleep(45)
        server.start()
        up_at = time.time()
        run_b = cli("run", second, server.url, log_b)

        assert run_a.wait(timeout=load_s + 240) == 0, log_a.read_text()[-3000:]
        assert run_b.wait(timeout=300) == 0, log_b.read_text()[-3000:]

        runs = server.post("/flow_runs/filter", {"sort": "START_TIME_ASC"})
        assert [r["state_type"] for r in runs] == ["COMPLETED", "COMPLETED"], runs
        a, b = runs
        a_end = at(a["end_time"])
        b_held = step_started(server, b["id"], "preflight")  # the first step after the lock
        b_changes = step_started(server, b["id"], "stop-autostart")
        assert b_held is not None and b_changes is not None
        assert b_held >= a_end, "run B took the cluster while run A held it"
        gap = b_held - a_end
        assert gap < 10, f"run B started {gap:.0f} s after run A's end"
        assert engine_ids(bed) != loading  # B redeployed, after A...
        assert b_changes > a_end  # ...and touched nothing before A's end
        unhealthy = server.post(
            "/events/filter", {"filter": {"event": {"name": ["vllm.cluster.unhealthy"]}}}
        )["events"]
        assert unhealthy == [], "the watcher reported a cluster that a run held"
        keep_for_notes(
            "lock_outage",
            "\n".join(
                [
                    f"server down at +0 s, up at +{up_at - down_at:.0f} s (run A loading)",
                    f"run A: {a['start_time']} → {a['end_time']} (Completed)",
                    f"run B: {b['start_time']} → {b['end_time']} (Completed)",
                    f"run B held the cluster {gap:.1f} s after run A's end",
                    "",
                    "run A's log:",
                    *[line for line in log_a.read_text().splitlines() if "lock" in line.lower()],
                    "",
                    "run B's log:",
                    *[line for line in log_b.read_text().splitlines() if "lock" in line.lower()],
                ]
            ),
        )
    finally:
        if watcher is not None:
            stop(watcher, grace=10)
        bed.down()


SCENARIOS: dict[str, Scenario] = {
    "away-90-s-twice": on_own_server(away_90_s_twice),
    "away-4-min-in-memory-leases": on_own_server(partial(away_4_minutes, first_ip=133)),
    "away-4-min-file-leases": on_own_server(partial(away_4_minutes, first_ip=139), FILE_LEASES),
    "holder-stopped-150-s": on_own_server(holder_stopped_150_s),
    "a-500-to-the-summary": a_500_to_the_summary_write,
    "restart-45-s-with-a-run-due": on_own_server(restart_45_s_with_a_run_due),
}


@pytest.fixture(scope="module")
def played(
    tmp_path_factory: pytest.TempPathFactory, prefect_api: str
) -> Iterator[dict[str, Future[None]]]:
    with ThreadPoolExecutor(len(SCENARIOS), thread_name_prefix="scenario") as pool:
        yield {
            name: pool.submit(play, tmp_path_factory.mktemp(name), prefect_api)
            for name, play in SCENARIOS.items()
        }


def test_away_90_s_in_the_load_and_again_at_the_summary_costs_nothing(
    played: dict[str, Future[None]],
) -> None:
    played["away-90-s-twice"].result()


@pytest.mark.parametrize("leases", ["in-memory", "file"])
def test_away_4_minutes_from_the_load_on_a_deployment_run_costs_nothing(
    played: dict[str, Future[None]], leases: str
) -> None:
    """With the server's default lease storage (in memory: forgotten on restart) and the one the
    shipped units set (on disk)."""
    played[f"away-4-min-{leases}-leases"].result()


def test_a_holder_stopped_150_s_keeps_the_cluster_from_a_waiting_run(
    played: dict[str, Future[None]],
) -> None:
    """While stopped it sends no heartbeat and beats no lock: Prefect may mark it Crashed, and
    run B must still wait for it, since its beat is younger than [lock] lease_s."""
    played["holder-stopped-150-s"].result()


def test_a_500_to_the_summary_write_leaves_the_cluster_up_and_the_run_says_so(
    played: dict[str, Future[None]],
) -> None:
    played["a-500-to-the-summary"].result()


def test_a_prefect_restart_during_a_load_keeps_the_lock_and_frees_it_at_the_end(
    played: dict[str, Future[None]],
) -> None:
    played["restart-45-s-with-a-run-due"].result()
