"""The redeploy benchmark end to end, small (N=2, one run, short load), so that it cannot rot.

It checks that every figure is produced, never how fast anything is: timings belong in
bench/results, not in assertions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
ROWS = (
    "flow wall",
    "overhead = wall − stand-in load",
    "Prefect bookkeeping",
    "overhead beyond bookkeeping",
    "readiness lag",
    "crash lag",
    "`ensure` on a healthy cluster",
    "`ensure`: containers restarted",
    "signed webhook call → flow run Running",
    "`vllm-redeploy probe`, fresh process",
    "`vllm-redeploy run`, fresh process, temporary API",
    "`vllm-redeploy run`, fresh process, real server",
    "reference, poll 2 s",
    "## From reboot to served",
    "overhead beyond the model's load, vLLM's own launcher (mp)",
    "overhead beyond the model's load, Ray",
    "preflight, an image known",
    "every node rebooted → after-reboot run Running",
    "## Steps",
    "## The product's own cost per step",
    "round trips on the critical path (ssh + requests), N=2",
    "| (whole run) |",
    "| ensure: (whole run) |",
    "one SSH round trip",
)


@pytest.mark.timeout(900)
def test_benchmark_writes_its_table_and_charts(prefect_server: str, tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "bench.redeploy",
        "--nodes",
        "2",
        "--runs",
        "1",
        "--load",
        "2",
        "--crash-load",
        "2",
        "--reference-polls",
        "2",  # the 60 s operator's polling would only add waiting
        "--first-ip",
        "185",
        "--api-url",
        prefect_server,
        "--no-real-engine",  # minutes of the real vLLM: tests/test_real_vllm.py runs it
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr[-4000:]
    table = (tmp_path / "latest.md").read_text()
    missing = [row for row in ROWS if row not in table]
    assert not missing, table
    for chart in ("latest-timeline.png", "latest-overhead.png"):
        assert (tmp_path / chart).read_bytes().startswith(b"\x89PNG"), chart
