"""The watcher's metrics, scraped by a real Prometheus (Debian's) while the bed serves: what
its HTTP API answers matches the bed, and a killed engine shows within two looks."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.alerts import remove_alerts, set_up_alerts
from deployments.cli.prefect_api import talking_to
from deployments.metrics import WatchMetrics, serve_metrics
from deployments.watcher import watch_clusters
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.testbed.procs import free_port, spawn, stop
from tests.testbed.receiver import arm, receiving, webhook_block
from vllm_redeploy.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
INTERVAL_S = 2  # the watcher's look, and Prometheus' scrape, in the test
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# Its own name: other modules' beds call theirs "bed" on the same Prefect server, and their
# runs' events would be taken for this one's.
CLUSTER = "watched"
DASHBOARD = Path(__file__).parents[1] / "deployments/grafana/vllm-redeploy.json"


@contextlib.contextmanager
def prometheus(target: str, root: Path) -> Iterator[str]:
    """A real Prometheus scraping ``target`` every second; its API's base URL."""
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: vllm-redeploy\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    port = free_port("127.0.0.1")
    proc = spawn(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        root / "prometheus.log",
    )
    try:
        yield f"http://127.0.0.1:{port}/api/v1"
    finally:
        stop(proc)


def query(api: str, promql: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{api}/query", params={"query": promql}, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def until(api: str, promql: str, seconds: float) -> list[dict[str, Any]]:
    """The query's result once it is not empty."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):  # not up yet: not JSON
            if found := query(api, promql):
                return found
        assert time.monotonic() < deadline, f"no data for {promql} within {seconds} s"
        time.sleep(0.5)


def test_prometheus_scrapes_what_the_watcher_sees_and_a_killed_engine_shows_in_two_looks(
    prefect_api: str, tmp_path: Path
) -> None:
    bed = make_bed(2, "h200", first_ip=87)
    stopped = threading.Event()
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(receiving("127.0.0.94"))
        stack.callback(bed.down)
        path = bed.write_config(
            bed.root / "run.toml",
            name=CLUSTER,
            vllm={"env": {"VRD_LOAD_SECONDS": "1"}},
            watch={"interval_s": INTERVAL_S, "generate_every": 1},
            alerts={"block": webhook_block(receiver)},
        )
        config = load_config(path, env_file=None)
        set_up_alerts(config)  # a healthy night, then a kill not yet past unhealthy_for_s: none
        stack.callback(remove_alerts, config)
        arm(prefect_api, receiver, config.name)
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
        assert state.is_completed(), state.result(raise_on_failure=False)
        metrics = WatchMetrics()
        port = free_port("127.0.0.1")
        server = serve_metrics(metrics, "127.0.0.1", port)
        stack.callback(server.shutdown)
        looker = threading.Thread(target=watch_clusters, args=([config], stopped, metrics))
        with talking_to({"PREFECT_API_URL": prefect_api}):
            looker.start()
        stack.callback(looker.join, 60)
        stack.callback(stopped.set)
        with prometheus(f"127.0.0.1:{port}", tmp_path) as api:
            on = f'{{cluster="{CLUSTER}"}}'
            healthy = until(api, 'vllm_redeploy_cluster_verdict{verdict="healthy"} == 1', 60)
            assert healthy[0]["metric"]["cluster"] == CLUSTER
            up = until(api, f"vllm_redeploy_node_up{on} == 1", 10)
            assert sorted(r["metric"]["node"] for r in up) == ["node-1", "node-2"]
            assert query(api, f"vllm_redeploy_cluster_problem{on} == 1") == []
            # The engine's own figures, relayed: the watcher's 1-token generations count.
            until(api, f"vllm_redeploy_engine_generation_tokens_total{on} > 0", 30)
            assert query(api, f"vllm_redeploy_engine_requests_waiting{on}")
            assert query(api, f"vllm_redeploy_engine_kv_cache_usage_ratio{on}")
            until(api, f"vllm_redeploy_generation_latency_seconds{on} > 0", 30)
            # The run that served it, read from Prefect at the watcher's first beat.
            run = until(api, f"vllm_redeploy_last_run_success{on}", 30)
            assert run[0]["value"][1] == "1"
            assert float(until(api, f"vllm_redeploy_served_after_seconds{on}", 5)[0]["value"][1])
            assert until(api, f"vllm_redeploy_recoveries{on}", 5)[0]["value"][1] == "0"
            # Its steps and its probe, from its vllm.cluster.ready event.
            steps = until(api, f"vllm_redeploy_served_run_step_duration_seconds{on}", 20)
            ran = state.result()["steps"]
            assert {r["metric"]["step"]: float(r["value"][1]) for r in steps} == ran
            probe = until(api, f"vllm_redeploy_probe_latency_seconds{on}", 5)
            assert float(probe[0]["value"][1]) == round(state.result()["probe"]["elapsed_s"], 3)
            # vLLM's own time for the weights, by the loader that read them (the stand-in's
            # image has no fast loader: vLLM's default).
            (weights,) = until(api, f"vllm_redeploy_weights_load_seconds{on}", 5)
            assert weights["metric"]["loader"] == "default" and float(weights["value"][1]) > 0
            scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            keep_for_notes("metrics-scrape", scrape)
            assert now_view(prefect_api).startswith(f"# {CLUSTER} now: healthy")
            # Every panel of the dashboard gets data, and its cluster list names the cluster.
            panels = json.loads(DASHBOARD.read_text())["panels"]
            for expr in [t["expr"] for panel in panels for t in panel["targets"]]:
                until(api, expr.replace("$cluster", CLUSTER), 15)
            listed = httpx.get(
                f"{api}/label/cluster/values",
                params={"match[]": "vllm_redeploy_cluster_verdict"},
                timeout=5,
            ).json()["data"]
            assert CLUSTER in listed

            with contextlib.closing(bed.nodes[0].engine.client()) as client:
                client.containers.get(f"vllm-redeploy-{CLUSTER}-engine").kill()
            killed = time.monotonic()
            until(api, 'vllm_redeploy_cluster_verdict{verdict="unhealthy"} == 1', 60)
            took = time.monotonic() - killed
            # Two looks, plus a scrape and the look's own time (a busy machine's share).
            keep_for_notes(
                "metrics-engine-killed", f"unhealthy in Prometheus {took:.1f} s after the kill"
            )
            assert took < 2 * INTERVAL_S + 12, took
            # The UI's view of the cluster: one artifact, updated in place.
            deadline = time.monotonic() + 30
            while not (view := now_view(prefect_api)).startswith(f"# {CLUSTER} now: unhealthy"):
                assert time.monotonic() < deadline, view
                time.sleep(0.5)
            assert "| node-1 | no |" in view and "| node-2 | yes |" in view, view
            assert f"Last run: {CLUSTER}-manual-redeploy, Completed " in view, view
            keep_for_notes("metrics-now-artifact", view)
            reasons = query(api, f"vllm_redeploy_cluster_problem{on} == 1")
            assert {r["metric"]["reason"] for r in reasons} >= {"not_running"}, reasons
            down = query(api, f"vllm_redeploy_node_up{on} == 0")
            assert [r["metric"]["node"] for r in down] == ["node-1"], down
        alerted = [b for b in receiver.bodies if "arming" not in b["subject"]]
        assert alerted == []  # the run served, and the kill is not unhealthy_for_s old


def test_watch_refuses_a_metrics_address_it_cannot_read() -> None:
    from typer.testing import CliRunner

    from deployments.cli import app

    example = Path(__file__).parents[1] / "cluster.example.toml"
    done = CliRunner().invoke(app, ["watch", "-c", str(example), "--metrics", "9764"])
    assert done.exit_code == 2
    assert "--metrics 9764 is not HOST:PORT" in done.output


def now_view(prefect_api: str) -> str:
    """The cluster's ``-now`` artifact's text; its versions: one (updated in place)."""
    found = httpx.post(
        f"{prefect_api}/artifacts/filter",
        json={"artifacts": {"key": {"any_": [f"{CLUSTER}-now"]}}},
        timeout=10,
    ).json()
    assert len(found) == 1, [a["id"] for a in found]
    return str(found[0]["data"])
