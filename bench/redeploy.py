"""The redeploy benchmark: overhead per node count, readiness and crash lags, `ensure`, the
webhook trigger, cold starts, and the operator's runbook as a reference, on the test bed.

    .venv/bin/python -m bench.redeploy [--nodes 2 4 8] [--runs 3] [--load 20] [--out bench/results]
        [--no-real-engine]

One real `prefect server start` for every run (its start is not counted); one bed per node
count. Writes <out>/latest.md (medians, targets, method), <out>/latest-timeline.png and
<out>/latest-overhead.png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the flows' step logs would drown ours

from bench import caches, chart, coldstart, cost, latest, measure, trigger
from bench.bookkeeping import bookkeeping_s, shape_of
from bench.figures import Bench, Extras, PerNodes
from bench.prefect_server import running_prefect_server, using_api
from bench.reference import reference
from bench.report import RESULTS, write_results
from tests.testbed.bed import TestBed

# This benchmark's loopback addresses, by position in --nodes (other suites use others).
FIRST_IPS = (150, 160, 170)
REAL_ENGINE_IP = 190


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def bed_of(nodes: int, first_ip: int) -> Iterator[TestBed]:
    # Short root: unix socket paths below it must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="vrd-b-", dir="/tmp"))
    bed = TestBed.up(nodes, "h200", root, first_ip=first_ip)
    say(f"bed of {nodes} nodes at 127.0.0.{first_ip} up in {bed.bring_up_s:.1f} s ({root})")
    try:
        yield bed
    finally:
        bed.down()


def measure_flow(api: str, bed: TestBed, result: PerNodes, args: argparse.Namespace) -> None:
    for i in range(args.runs):
        done = measure.redeploy(api, bed, f"ok{i}", args.load)
        result.redeploys.append(done)
        say(f"N={result.nodes} redeploy {i + 1}: wall {done.run.wall_s:.1f} s")
        result.ensures.append(measure.ensure(api, bed, done))
    for i in range(args.runs):
        done = measure.redeploy(api, bed, f"mp{i}", args.load, backend="mp")
        result.mp_redeploys.append(done)
        say(f"N={result.nodes} mp redeploy {i + 1}: wall {done.run.wall_s:.1f} s")
    shape = shape_of(result.redeploys[0].run.record.tasks)
    result.bookkeeping = [bookkeeping_s(shape) for _ in range(args.runs)]


def measure_crashes(api: str, bed: TestBed, result: PerNodes, args: argparse.Namespace) -> None:
    for i in range(args.runs):
        result.crashes.append(measure.crash(api, bed, f"crash{i}", args.crash_load))
    say(f"N={result.nodes} crash runs done")


def measure_extras(
    api: str, bed: TestBed, result: PerNodes, args: argparse.Namespace, work: Path
) -> Extras:
    extras = Extras(len(bed.nodes))
    # The Ray group again (the mp runs came last): the triggered `ensure` runs find it healthy.
    served = measure.redeploy(api, bed, "served", args.load).run
    lags = trigger.webhook_to_running(api, bed, served.env, args.runs)
    extras.webhook_s, extras.reboot_all_s = lags.one_node_s, lags.all_nodes_s
    extras.reboot_delay_s = lags.delay_s
    say("webhook → Running done")
    extras.probe_cold_s = [coldstart.probe_s(served.config) for _ in range(args.runs)]
    home = work / "temporary-api-home"
    coldstart.prepare_temporary_home(home)
    for i in range(args.runs):
        env = measure.stand_in_env(bed, f"cold{i}", args.load)
        config = measure.write_config(bed, f"cold{i}", env, vllm={"backend": "ray"})
        extras.run_server_s.append(coldstart.run_s(config, api, home))
        extras.run_temporary_s.append(coldstart.run_s(config, None, home))
    say("cold starts done")
    for poll in args.reference_polls:
        extras.references[poll] = [
            reference(bed, f"ref{poll:g}-{i}", args.load, poll) for i in range(args.runs)
        ]
        say(f"reference with {poll:g} s polling done")
    return extras


def run_bench(api: str, args: argparse.Namespace, work: Path) -> Bench:
    bench = Bench(args.runs, args.load, args.crash_load)
    for position, nodes in enumerate(sorted(args.nodes)):
        first_ip = args.first_ip or FIRST_IPS[position]
        result = bench.per_nodes[nodes] = PerNodes(nodes)
        with bed_of(nodes, first_ip) as bed:
            measure_flow(api, bed, result, args)
            if position == 0:
                bench.floors = cost.floors(result.redeploys[0].run.config, bed)
                say(f"floors: {bench.floors}")
                bench.extras = measure_extras(api, bed, result, args, work)
            measure_crashes(api, bed, result, args)
    if bench.extras is not None and args.real_engine:
        root = Path(tempfile.mkdtemp(prefix="vrd-b-", dir="/tmp"))
        try:
            bench.extras.caches = caches.real_engine_starts(root, REAL_ENGINE_IP, say)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return bench


def write(bench: Bench, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    chart.write_timeline(bench, out / "latest-timeline.png")
    chart.write_overhead(bench, out / "latest-overhead.png")
    write_results("latest", latest.render(bench), out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--runs", type=int, default=3, help="repetitions per figure (median)")
    parser.add_argument("--load", type=float, default=20.0, help="stand-in load time, s")
    parser.add_argument("--crash-load", type=float, default=4.0, help="load of the crash runs, s")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--reference-polls",
        type=float,
        nargs="+",
        default=[60.0, 10.0],
        help="the reference runbook's /v1/models polling intervals, s",
    )
    parser.add_argument("--api-url", help="use this Prefect server instead of starting one")
    parser.add_argument(
        "--no-real-engine",
        dest="real_engine",
        action="store_false",
        help="skip the real vLLM's starts with and without the compile cache (minutes)",
    )
    parser.add_argument("--first-ip", type=int, help="put every bed at 127.0.0.K (default 150..)")
    args = parser.parse_args(argv)
    if len(args.nodes) > len(FIRST_IPS) and args.first_ip is None:
        parser.error(f"at most {len(FIRST_IPS)} node counts (or give --first-ip)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="vrd-b-", dir="/tmp"))
    try:
        with contextlib.ExitStack() as stack:
            api = args.api_url or stack.enter_context(running_prefect_server(work))
            stack.enter_context(using_api(api))
            say(f"Prefect server at {api}")
            meter = stack.enter_context(cost.metered(api))
            bench = run_bench(api, args, work)
            bench.meter = meter
        write(bench, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"benchmark took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
