"""The cluster's lock through a Prefect server restart (issue 34, item 1), on the bed against a
Prefect server of its own that the test stops and starts again: run A is loading, the watcher
looks every few seconds, the server is down for 45 s and comes back on the same database, and
run B of the same cluster is due. A's load completes, nothing touches A's group while A runs,
and B starts within seconds of A's end (instead of waiting out `[lock] wait_s` for a slot whose
lease the server forgot)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import keep_for_notes, make_bed
from tests.testbed.bed import TestBed
from tests.testbed.prefect_server import PrefectServer, at, cli, step_started
from tests.testbed.procs import stop, wait_until
from vllm_redeploy.nodes.containers import LABEL_MANAGED

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent
OUTAGE_S = 45


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrefectServer]:
    home = tmp_path / "prefect-home"
    home.mkdir()
    server = PrefectServer(home)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def engine_ids(bed: TestBed) -> dict[str, str]:
    with contextlib.closing(bed.nodes[0].engine.client()) as client:
        return {c.name: c.id for c in client.containers.list(filters={"label": LABEL_MANAGED})}


def test_a_prefect_restart_during_a_load_keeps_the_lock_and_frees_it_at_the_end(
    server: PrefectServer, tmp_path: Path
) -> None:
    bed = make_bed(2, "h200", first_ip=107)
    watcher: subprocess.Popen[bytes] | None = None
    try:
        cluster = f"outage{uuid.uuid4().hex[:6]}"
        load_s = 75
        first = bed.write_config(
            tmp_path / "a.toml",
            name=cluster,
            vllm={"env": {"VRD_LOAD_SECONDS": str(load_s)}},
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
        watcher = cli("watch", first, server.url, tmp_path / "watch.log")
        wait_until(lambda: "step wait-ready" in log_a.read_text(), 180, "run A loading", log_a)
        group = engine_ids(bed)

        server.stop()
        down_at = time.time()
        time.sleep(OUTAGE_S)
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
        assert engine_ids(bed) != group  # B redeployed, after A...
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
