"""How much time the flow adds around the model's own load, and how fast it notices.

    .venv/bin/python -m bench.flow_timing [--nodes 2 4] [--load 10] [--runs 3] [--backends ray mp]

Per launch backend (Ray, or vLLM's own multi-node launcher), on the test bed, with one real
Prefect server for all runs (its start is not counted): per node count, the flow's wall time minus
the stand-in's load time (overhead), the lag between the stand-in starting to serve and the flow's
wait-ready step finishing (readiness lag), and, with an engine killed during load, the lag between
the kill and the wait-ready step failing (crash lag).
Medians of ``--runs`` runs; writes bench/results/flow_timing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.testing.utilities import prefect_test_harness

from bench.report import write_results
from flows.redeploy import redeploy_vllm_cluster
from tests.testbed.bed import TestBed


async def _task_end(flow_run_id: Any, name: str) -> float:
    async with get_client() as client:
        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    run = next(r for r in runs if r.name.startswith(name))
    assert run.end_time is not None
    return run.end_time.timestamp()


def _events(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    return {e["event"]: e["t"] for e in map(json.loads, path.read_text().splitlines())}


def one_run(bed: TestBed, backend: str, load_s: float, fault: str = "") -> dict[str, float]:
    events = bed.observed / f"events-{time.monotonic_ns()}.jsonl"
    env = {"VRD_LOAD_SECONDS": str(load_s), "VRD_EVENT_LOG": str(events)}
    if fault:
        env["VRD_FAULT"] = fault
    path = bed.write_config(bed.root / "bench.toml", vllm={"env": env, "backend": backend})
    started = time.time()
    state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    wall = time.time() - started
    ended = asyncio.run(_task_end(state.state_details.flow_run_id, "wait-ready"))
    seen = _events(events)
    if fault:
        assert state.is_failed(), state
        return {"crash_lag_s": ended - seen["crashed"], "failed_after_s": wall}
    assert state.is_completed(), state.result(raise_on_failure=False)
    return {"overhead_s": wall - load_s, "ready_lag_s": ended - seen["listening"], "wall_s": wall}


def measure(backend: str, nodes: int, load_s: float, runs: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="vrd-bench-", dir="/tmp"))
    bed = TestBed.up(nodes, "h200", root, first_ip=100)
    try:
        ok = [one_run(bed, backend, load_s) for _ in range(runs)]
        crash = [one_run(bed, backend, 4.0, "crash_during_load") for _ in range(runs)]
    finally:
        bed.down()
    rows = ok + crash
    keys = {k for r in rows for k in r}
    return {k: statistics.median(r[k] for r in rows if k in r) for k in sorted(keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--load", type=float, default=10.0, help="stand-in load time, s")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", nargs="+", choices=["ray", "mp"], default=["ray", "mp"])
    args = parser.parse_args()
    with prefect_test_harness(server_startup_timeout=60):
        results = {
            (b, n): measure(b, n, args.load, args.runs) for b in args.backends for n in args.nodes
        }
    lines = [
        f"# Flow timing on the test bed (median of {args.runs}; stand-in load {args.load:g} s)",
        "",
        "| backend | nodes | flow wall s | overhead s (wall - load) | readiness lag s "
        "| crash lag s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (b, n), r in results.items():
        lines.append(
            f"| {b} | {n} | {r['wall_s']:.1f} | {r['overhead_s']:.1f} | {r['ready_lag_s']:.2f} "
            f"| {r['crash_lag_s']:.2f} |"
        )
    write_results("flow_timing", lines)


if __name__ == "__main__":
    main()
