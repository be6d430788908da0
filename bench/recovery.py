"""How fast a crashed cluster is noticed and served again, without a person (issue 16).

On a 2-node bed with one real `prefect server start`, `vllm-redeploy serve` and `vllm-redeploy
watch` run as the controller would; the model is deployed once, then, ``--runs`` times, the engine
container is killed at a random moment while serving and two figures are taken:

- crash -> ``vllm.cluster.unhealthy`` emitted (the event's own ``occurred``, Prefect's record);
  target: at most ``interval_s x failures + 1 s``;
- crash -> served again (the probe healthy on the head), target: the detection plus one redeploy
  (the flow's own wall time, from the recovery run's record).

Each recovery counts toward the crash-loop limit: the bench resumes the cluster before each crash
(a person's resume starts the count anew), which is what lets it measure many crashes in a row.

    .venv/bin/python -m bench.recovery [--runs 5] [--interval 2] [--failures 2]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

from bench.prefect_server import QUIET, running_prefect_server, using_api
from tests.test_deployments import api, deployments_by_name
from tests.testbed.bed import SERVED_NAME, TestBed
from tests.testbed.procs import spawn, stop, wait_until
from vllm_redeploy.probe import run_probe

BIN = Path(sys.executable).parent
FIRST_IP = 155


def say(text: str) -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--interval", type=float, default=2.0, help="[watch] interval_s")
    parser.add_argument("--failures", type=int, default=2, help="[watch] failures")
    parser.add_argument("--load", type=float, default=5.0, help="the stand-in's load, seconds")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vrd-bench-recovery-", dir="/tmp"))
    rows = []
    with running_prefect_server(work) as url, using_api(url):
        bed = TestBed.up(2, "h200", work / "bed", first_ip=FIRST_IP)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            rows = measure(url, bed, args, procs)
        finally:
            for proc in procs:
                stop(proc, grace=10)
            bed.down()
    write(rows, args)


def measure(url: str, bed: TestBed, args: argparse.Namespace, procs: list) -> list[dict]:  # type: ignore[type-arg]
    from flows.redeploy import redeploy_vllm_cluster

    cluster = f"bench{uuid.uuid4().hex[:6]}"
    path = bed.write_config(
        bed.root / "bench.toml",
        name=cluster,
        vllm={"env": {"VRD_LOAD_SECONDS": f"{args.load:g}"}},
        watch={"interval_s": args.interval, "failures": args.failures, "backoff_s": 1},
    )
    state = redeploy_vllm_cluster(str(path), return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    env = {**QUIET, "PREFECT_API_URL": url}
    for name in ("serve", "watch"):
        procs.append(
            spawn(
                [str(BIN / "vllm-redeploy"), name, "-c", str(path)], bed.root / f"{name}.log", env
            )
        )
    wait_until(lambda: f"{cluster}-recover" in deployments_by_name(url), 60, "serve", None)
    head = bed.nodes[0]
    rows = []
    for i in range(args.runs):
        subprocess.run(
            [str(BIN / "vllm-redeploy"), "resume", "-c", str(path)],
            env={**env, "PATH": "/usr/bin:/bin"},
            check=True,
            capture_output=True,
        )
        time.sleep(random.uniform(1.0, 3.0))  # noqa: S311 - a random moment while serving
        with contextlib.closing(head.engine.client()) as client:
            client.containers.get(f"vllm-redeploy-{cluster}-engine").kill()
        crashed = time.time()
        event = wait(lambda at=crashed: unhealthy_after(url, cluster, at), 120)
        served = wait(lambda: healthy(head.ip), 600)
        run = last_recovery(url, cluster)
        row = {
            "run": i + 1,
            "detect_s": event - crashed,
            "served_s": served - crashed,
            "redeploy_s": run,
        }
        rows.append(row)
        say(
            f"crash {i + 1}: unhealthy after {row['detect_s']:.1f} s, served after "
            f"{row['served_s']:.1f} s (redeploy {run:.1f} s)"
        )
    return rows


def wait(check, timeout: float) -> float:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError("the bench waited too long")


def unhealthy_after(url: str, cluster: str, since: float) -> float | None:
    body = {
        "filter": {
            "event": {"name": ["vllm.cluster.unhealthy"]},
            "resource": {"id": [f"vllm-redeploy.cluster.{cluster}"]},
            "occurred": {"since": datetime.fromtimestamp(since).astimezone().isoformat()},
        },
        "limit": 5,
    }
    events = api(url, "POST", "/events/filter", body)["events"]
    stamps = [datetime.fromisoformat(e["occurred"]).timestamp() for e in events]
    return min(stamps) if stamps else None


def healthy(ip: str) -> float | None:
    ok = run_probe(f"http://{ip}:30000", SERVED_NAME, "Hi.", 50, 0.0, 5).healthy
    return time.time() if ok else None


def last_recovery(url: str, cluster: str) -> float:
    deployment = deployments_by_name(url)[f"{cluster}-recover"]
    body = {
        "flow_runs": {"deployment_id": {"any_": [deployment["id"]]}},
        "sort": "START_TIME_DESC",
        "limit": 1,
    }
    deadline = time.monotonic() + 120
    while True:
        (run,) = api(url, "POST", "/flow_runs/filter", body)
        if run["end_time"]:
            return float(run["total_run_time"])
        if time.monotonic() > deadline:
            return float("nan")
        time.sleep(0.5)


def write(rows: list[dict], args: argparse.Namespace) -> None:  # type: ignore[type-arg]
    if not rows:
        return
    detect = statistics.median(r["detect_s"] for r in rows)
    served = statistics.median(r["served_s"] for r in rows)
    redeploy = statistics.median(r["redeploy_s"] for r in rows)
    target = args.interval * args.failures + 1
    lines = [
        "# Recovery: crash -> noticed -> served again (bench/recovery.py)",
        "",
        f"2-node bed, stand-in load {args.load:g} s, `[watch] interval_s = {args.interval:g}`, "
        f"`failures = {args.failures}`; {len(rows)} crashes (the engine killed at a random "
        "moment while serving), medians.",
        "",
        "| figure | median, s | target | met |",
        "| --- | --- | --- | --- |",
        f"| crash -> vllm.cluster.unhealthy | {detect:.1f} | <= interval x failures + 1 = "
        f"{target:g} | {'yes' if detect <= target else 'no'} |",
        f"| recovery run (ensure: inspect, then the redeploy) | {redeploy:.1f} | | |",
        f"| crash -> served again | {served:.1f} | detection + one redeploy = "
        f"{detect + redeploy:.1f} | {'yes' if served <= detect + redeploy + 3 else 'no'} |",
        "",
        "| crash | unhealthy after, s | served after, s | recovery run, s |",
        "| --- | --- | --- | --- |",
        *(
            f"| {r['run']} | {r['detect_s']:.1f} | {r['served_s']:.1f} | {r['redeploy_s']:.1f} |"
            for r in rows
        ),
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recovery.md").write_text("\n".join(lines))
    say("\n".join(lines))


if __name__ == "__main__":
    main()
