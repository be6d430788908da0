"""Test-bed bring-up time and memory, idle and with a deployment running.

    .venv/bin/python -m bench.testbed_bringup [--nodes 2 4] [--runs 3]

Memory is the summed resident set (RSS) of every process the bed runs: each node's sshd and
Docker engine with everything below them (containerd, shims, containers: Ray, the vLLM stand-in).
Writes bench/results/testbed_bringup.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect.testing.utilities import prefect_test_harness

from bench.report import write_results
from flows.redeploy import redeploy_vllm_cluster
from tests.testbed.bed import TestBed
from tests.testbed.procs import descendants, pids_with_arg


def bed_rss_mib(bed: TestBed) -> float:
    pids: set[int] = set()
    for node in bed.nodes:
        roots = [node.spec.sshd_pid, node.spec.dockerd_pid, *pids_with_arg(str(node.root / "d"))]
        for pid in roots:
            pids.add(pid)
            pids.update(descendants(pid))
    total_kib = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def one(nodes: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="vrd-bringup-", dir="/tmp"))
    bed = TestBed.up(nodes, "h200", root, first_ip=120)
    try:
        idle = bed_rss_mib(bed)
        path = bed.write_config(bed.root / "m.toml", vllm={"env": {"VRD_LOAD_SECONDS": "1"}})
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
        assert state.is_completed(), state.result(raise_on_failure=False)
        serving = bed_rss_mib(bed)
    finally:
        bed.down()
    return {"up_s": bed.bring_up_s, "idle_mib": idle, "serving_mib": serving}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    lines = [
        f"# Test-bed bring-up (median of {args.runs})",
        "",
        "| nodes | bring-up s | memory idle MiB | memory with Ray + vLLM stand-in MiB |",
        "| --- | --- | --- | --- |",
    ]
    with prefect_test_harness(server_startup_timeout=60):
        for n in args.nodes:
            runs = [one(n) for _ in range(args.runs)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            lines.append(
                f"| {n} | {med['up_s']:.1f} | {med['idle_mib']:.0f} | {med['serving_mib']:.0f} |"
            )
    write_results("testbed_bringup", lines)


if __name__ == "__main__":
    main()
