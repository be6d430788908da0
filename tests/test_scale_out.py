"""Scaling out on Prefect (issue 17): one Prefect server on a real PostgreSQL, one process work
pool, two named workers (separate `prefect worker start` processes), two clusters deployed from
this repository's prefect.yaml with `prefect --no-prompt deploy --all`, as the README says.

(a) two clusters' runs execute at the same time, on different workers;
(b) two runs of one cluster, both Running on different workers, never touch it at the same time
    (from each one's first step after the cluster lock to its end);
(c) a worker killed mid-run (SIGKILL): its run's output goes through the worker, so the run
    ends itself at its next line, Crashed (as the API says), handing the cluster back; the next
    run of the cluster, on the other worker, starts at once and replaces what the dead run left
    on the nodes (as their Docker engines list).

One server, two workers and two beds serve the whole module; it prints its wall time and what a
worker running two flows costs (CPU, memory).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.zombies import SILENCE_S
from tasks.guard import guard_run
from tests.conftest import make_bed
from tests.test_cluster_lock import ours
from tests.test_deployments import api, deployments_by_name
from tests.testbed.bed import TestBed
from tests.testbed.postgres import PostgresServer, unavailable
from tests.testbed.procs import (
    alive,
    claim,
    descendants,
    free_port,
    kill_tree,
    pids_with_env,
    spawn,
    wait_until,
)
from vllm_redeploy.launch.group import ENGINE_ROLE
from vllm_redeploy.launch.ray import RAY_ROLE
from vllm_redeploy.names import container_name, lock_name

NO_POSTGRES = unavailable()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(NO_POSTGRES is not None, reason=f"needs a PostgreSQL: {NO_POSTGRES}"),
]
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
POOL = "vllm-redeploy"  # prefect.yaml's work pool
LEASE_S = 60  # [lock] lease_s, Prefect's minimum
LONG_LEASE_S = 600  # (c): far longer than a crashed run's hand-back takes
HEARTBEAT_S = "30"  # what deployments/zombies.py expects of every process that runs flows
QUERY_S = "2"  # how often a worker asks for runs (Prefect's default is 10 s)
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
PAGE = 200  # the API's largest page
LOAD_S = "2"  # VRD_LOAD_SECONDS of every run but these:
HELD_LOAD_S = "30"  # (a, b): A's first run, long enough for A's second and B's to arrive meanwhile


@dataclass
class Cluster:
    name: str
    bed: TestBed
    config: Path
    deployments: dict[str, str] = field(default_factory=dict)  # kind -> deployment id

    def write_config(self, path: Path, env: dict[str, str], lease_s: float = LEASE_S) -> Path:
        """The cluster's cluster.toml for its bed, the vLLM stand-in told ``env``."""
        return self.bed.write_config(
            path, name=self.name, vllm={"env": env}, lock={"lease_s": lease_s}
        )


@dataclass
class Platform:
    url: str
    root: Path
    clusters: dict[str, Cluster]
    server: subprocess.Popen[bytes]
    postgres: PostgresServer
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        """What every Prefect client process here gets: the server, its own PREFECT_HOME."""
        return {
            "PREFECT_API_URL": self.url,
            "PREFECT_HOME": str(self.root / "client-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **extra,
        }

    def start_worker(self, name: str, limit: int) -> subprocess.Popen[bytes]:
        """`prefect worker start` on the pool, heartbeats on; returns once the server lists it."""
        argv = [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--name", name]
        # The configurations its runs may use: each cluster's, and the variants the tests write.
        served = [c.config for c in self.clusters.values()]
        served += [self.root / f"scale-a-{variant}.toml" for variant in ("held", "slow")]
        env = self.env(
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY=HEARTBEAT_S,
            PREFECT_WORKER_QUERY_SECONDS=QUERY_S,
            VLLM_REDEPLOY_CONFIG=os.pathsep.join(map(str, served)),
        )
        log = self.worker_log(name)
        self.workers[name] = spawn([*argv, "--limit", str(limit)], log, env)
        deadline = time.monotonic() + 90
        while self.worker_status(name) != "ONLINE":
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        return self.workers[name]

    def usage(self, worker: int) -> Usage:
        """Start sampling the worker, the server and PostgreSQL."""
        assert self.postgres.proc is not None
        trees = {
            "worker w1 and its flow runs": Tree(worker),
            "prefect server": Tree(self.server.pid),
            "postgresql": Tree(self.postgres.proc.pid),
        }
        return Usage(trees, self.postgres.connections).start()

    def worker_log(self, name: str) -> Path:
        return self.root / f"worker-{name}.log"

    def worker_status(self, name: str) -> str | None:
        listed = api(self.url, "POST", f"/work_pools/{POOL}/workers/filter", {})
        return next((w["status"] for w in listed if w["name"] == name), None)

    def create_run(self, cluster: str, kind: str, **parameters: str) -> str:
        """A flow run of the cluster's deployment, as a click in the UI makes one."""
        deployment = self.clusters[cluster].deployments[kind]
        body = {"parameters": {"mode": "redeploy", **parameters}}
        return api(self.url, "POST", f"/deployments/{deployment}/create_flow_run", body)["id"]


# --- the platform: PostgreSQL, the Prefect server, beds, deployments, workers -----------------


@pytest.fixture(scope="module")
def platform(request: pytest.FixtureRequest) -> Iterator[Platform]:
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="vrd-scale-", dir="/tmp"))
    claim(root)
    postgres = PostgresServer(Path(tempfile.mkdtemp(prefix="vrd-pg-", dir="/tmp")))
    claim(postgres.root)
    server: subprocess.Popen[bytes] | None = None
    beds: list[TestBed] = []
    platform = None
    try:
        postgres.start()
        server, url = start_server(root, postgres.url)
        with ThreadPoolExecutor(max_workers=2) as pool:  # while the server migrates its schema
            # On Ray: a replaced group is checked container by container, Ray's among them.
            beds = list(
                pool.map(lambda ip: make_bed(2, "h200", first_ip=ip, backend="ray"), (211, 215))
            )
        wait_until(lambda: healthy(url), 120, "prefect server on PostgreSQL", root / "server.log")
        platform = Platform(url, root, clusters(root, beds), server, postgres)
        prefect(platform, "work-pool", "create", POOL, "--type", "process")
        deploy_everything(platform)
        platform.start_worker("w2", limit=1)
        say(
            request,
            f"test_scale_out: PostgreSQL, server, beds, deployments, worker in "
            f"{time.monotonic() - started:.0f} s",
        )
        yield platform
    finally:
        for proc in platform.workers.values() if platform else []:
            kill_tree(proc.pid, grace=10)  # the worker and the flow runs it started
        if server is not None:
            kill_tree(server.pid, grace=15)
        postgres.stop()
        for bed in beds:
            bed.down()
        shutil.rmtree(root, ignore_errors=True)
        say(request, f"test_scale_out: the module took {time.monotonic() - started:.0f} s")


def start_server(root: Path, database_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """`prefect server start` on PostgreSQL with its own PREFECT_HOME; not waited for."""
    port = free_port("127.0.0.1")
    home = root / "server-home"
    home.mkdir()
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_UI_ENABLED": "false",  # nobody looks; it starts sooner
        "PREFECT_API_URL": "",
    }
    argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return spawn(argv, root / "server.log", env), f"http://127.0.0.1:{port}/api"


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def clusters(root: Path, beds: list[TestBed]) -> dict[str, Cluster]:
    """Cluster A on the first bed, B on the second."""
    found = {}
    for key, bed in zip(("a", "b"), beds, strict=True):
        name = f"scale-{key}"
        found[key] = Cluster(name, bed, root / f"{name}.toml")
        found[key].write_config(found[key].config, {"VRD_LOAD_SECONDS": LOAD_S})
    return found


def prefect(platform: Platform, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(BIN / "prefect"), *args],
        env={**os.environ, **platform.env(), **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def deploy_everything(platform: Platform) -> None:
    """Each cluster's four deployments from prefect.yaml (the README's three variables), and
    the zombie automation, once, as a worker set-up needs it."""
    for cluster in platform.clusters.values():
        env = {
            "VLLM_REDEPLOY_CLUSTER": cluster.name,
            "VLLM_REDEPLOY_CONFIG": str(cluster.config),
            "VLLM_REDEPLOY_HOME": str(REPO),
        }
        prefect(platform, "--no-prompt", "deploy", "--all", env=env)
    found = deployments_by_name(platform.url)
    for cluster in platform.clusters.values():
        for kind in ("manual", "nightly"):
            deployment = found[f"{cluster.name}-{kind}"]
            assert deployment["work_pool_name"] == POOL
            cluster.deployments[kind] = deployment["id"]
            for schedule in deployment["schedules"]:  # a 04:00 UTC run is none of this module's
                path = f"/deployments/{deployment['id']}/schedules/{schedule['id']}"
                api(platform.url, "PATCH", path, {"active": False})
    install = "from deployments.zombies import ensure_zombie_automation as e; e()"
    subprocess.run(
        [sys.executable, "-c", install],
        env={**os.environ, **platform.env()},
        cwd=REPO,
        check=True,
        timeout=120,
    )


def say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal even when output is captured (-s not needed)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:  # an xdist worker: nobody reads its terminal
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


# --- reading runs back ----------------------------------------------------------------------------


def runs(url: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    found = api(url, "POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}})
    return {r["id"]: r for r in found}


def wait_for(
    url: str, ids: list[str], done: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = runs(url, ids)
        if len(found) == len(ids) and all(done(r) for r in found.values()):
            return found
        summary = [(r["name"], r["state_type"], r["state_name"]) for r in found.values()]
        assert time.monotonic() < deadline, f"{what} after {timeout:g} s: {summary}"
        time.sleep(1)


def worker_of(run: dict[str, Any]) -> str | None:
    """The worker that took the run: it labels the run with its name when it submits it."""
    return run.get("labels", {}).get("prefect.worker.name")


def taken(run: dict[str, Any]) -> bool:
    return worker_of(run) is not None and run["state_type"] in ("PENDING", "RUNNING", *FINAL)


def logs(url: str, run_id: str, text: str) -> list[tuple[float, str]]:
    """The run's log lines containing ``text``: (timestamp, message), oldest first."""
    return [
        (stamp(entry["timestamp"]), entry["message"])
        for entry in log_entries(url, run_id, text)
        if text in entry["message"]
    ]


def log_entries(url: str, run_id: str, text: str = "") -> list[dict[str, Any]]:
    """The run's log records as the API keeps them, oldest first, every page."""
    where: dict[str, Any] = {"flow_run_id": {"any_": [run_id]}}
    if text:
        where["text"] = {"query": f'"{text}"'}
    found: list[dict[str, Any]] = []
    while True:
        body = {"logs": where, "sort": "TIMESTAMP_ASC", "offset": len(found), "limit": PAGE}
        page = api(url, "POST", "/logs/filter", body)
        found += page
        if len(page) < PAGE:
            return found


def stamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def work_window(url: str, run: dict[str, Any]) -> tuple[float, float]:
    """When the run worked on its cluster, from the state timestamps of its task runs: every
    command to a node runs in a task, and all of them inside the cluster lock but the guard
    before it. First waits until the API has, finished, every task run that the run's log names
    (the log is complete once the flow's own closing line is in: it is sent in order)."""
    deadline = time.monotonic() + 60
    while True:
        entries = log_entries(url, run["id"])
        closed = any(
            e["task_run_id"] is None and e["message"].startswith("Finished in state")
            for e in entries
        )
        named = {e["task_run_id"] for e in entries if e["task_run_id"]}
        body = {"flow_runs": {"id": {"any_": [run["id"]]}}, "limit": PAGE}
        tasks = {t["id"]: t for t in api(url, "POST", "/task_runs/filter", body)}
        if closed and named <= {i for i, t in tasks.items() if t["end_time"]}:
            break
        assert time.monotonic() < deadline, f"{run['name']}: task runs missing from the API"
        time.sleep(1)
    inside = [t for t in tasks.values() if t["name"] != guard_run.task_run_name]
    starts = [stamp(t["start_time"]) for t in inside if t["start_time"]]
    assert starts, f"{run['name']} ran no step on its cluster"
    return min(starts), max(stamp(t["end_time"]) for t in inside)


def eventually(check: Callable[[], Any], timeout: float, what: str, url: str, run_id: str) -> None:
    """Ask the API once a second until ``check`` is true; on timeout show the run's log."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            lines = [m for _, m in logs(url, run_id, "")][-30:]
            pytest.fail(f"{what}: not after {timeout:g} s; the run's log:\n" + "\n".join(lines))
        time.sleep(1)


def overlap(one: tuple[float, float], other: tuple[float, float]) -> bool:
    return one[0] < other[1] and other[0] < one[1]


# --- what it costs ----------------------------------------------------------------------------


@dataclass
class Tree:
    """A process and everything below it: CPU seconds (per process, the last seen) and the peak
    of its memory, as PSS (shared pages split between their users, so trees add up)."""

    pid: int
    cpu_s: dict[int, float] = field(default_factory=dict)
    peak_mib: float = 0.0
    own_peak_mib: float = 0.0  # the root process alone
    peak_runs: int = 0  # flow-run processes (`python -m prefect.engine`) at once

    def sample(self) -> None:
        total, runs = 0.0, 0
        for pid in [self.pid, *descendants(self.pid)]:
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.cpu_s[pid] = _cpu_s(pid)
                here = _pss_mib(pid)
                total += here
                if pid == self.pid:
                    self.own_peak_mib = max(self.own_peak_mib, here)
                runs += b"prefect.engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
        self.peak_mib = max(self.peak_mib, total)
        self.peak_runs = max(self.peak_runs, runs)

    def said(self, wall: float) -> str:
        cpu = sum(self.cpu_s.values())
        return (
            f"peak {self.peak_mib:.0f} MiB (its root {self.own_peak_mib:.0f} MiB), "
            f"{cpu:.1f} CPU-s in {wall:.0f} s ({100 * cpu / wall:.0f}% of one core)"
        )


@dataclass
class Usage:
    """What the worker running two flows, the server and PostgreSQL use; sampled each second."""

    trees: dict[str, Tree]
    connections: Callable[[], int]
    peak_connections: int = 0
    started: float = field(default_factory=time.monotonic)
    stopped: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Usage:
        threading.Thread(target=self._loop, daemon=True).start()
        return self

    def stop(self) -> list[str]:
        self.stopped.set()
        wall = time.monotonic() - self.started
        lines = [f"{name}: {tree.said(wall)}" for name, tree in self.trees.items()]
        runs = max(tree.peak_runs for tree in self.trees.values())
        return [
            *lines,
            f"up to {runs} flow runs in one worker, {self.peak_connections} "
            "connections to PostgreSQL",
        ]

    def _loop(self) -> None:
        while not self.stopped.wait(1.0):
            for tree in self.trees.values():
                tree.sample()
            with contextlib.suppress(RuntimeError, ValueError, subprocess.SubprocessError):
                self.peak_connections = max(self.peak_connections, self.connections())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


# --- (a) and (b) ------------------------------------------------------------------------------


def test_two_clusters_side_by_side_one_run_per_cluster_across_workers(
    platform: Platform, request: pytest.FixtureRequest
) -> None:
    """w2 (--limit 1) takes A's manual run; w1 (--limit 2), started then, can only take A's
    nightly run and B's manual run: A's two runs are both Running, on different workers, and
    take turns at the cluster; B runs beside A, on the other worker than A's first run."""
    url, cluster = platform.url, platform.clusters["a"]
    held = cluster.write_config(
        platform.root / "scale-a-held.toml", {"VRD_LOAD_SECONDS": HELD_LOAD_S}
    )
    a1 = platform.create_run("a", "manual", config_path=str(held))
    wait_for(url, [a1], taken, 60, "nobody took A's first run")
    eventually(lambda: logs(url, a1, "step preflight"), 90, "A's first run holding it", url, a1)
    worker = platform.start_worker("w1", limit=2)
    usage = platform.usage(worker.pid)
    size = platform.postgres.size_mib()
    a2, b1 = platform.create_run("a", "nightly"), platform.create_run("b", "manual")
    ids = [a1, a2, b1]
    both = wait_for(url, [a2, a1], lambda r: r["state_type"] in ("RUNNING", *FINAL), 90, "A2")
    assert all(r["state_type"] == "RUNNING" for r in both.values()), "A's runs never both Running"
    done = wait_for(url, ids, lambda r: r["state_type"] in FINAL, 300, "runs did not end")
    for line in usage.stop():
        say(request, f"test_scale_out: {line}")
    grown = platform.postgres.size_mib() - size
    say(request, f"test_scale_out: the database grew {grown:.1f} MiB in these {len(ids)} runs")
    assert [done[i]["state_type"] for i in ids] == ["COMPLETED"] * 3, tails(platform)
    assert [worker_of(done[i]) for i in ids] == ["w2", "w1", "w1"]
    for run_id in ids:  # the worker's own words, in the run's log
        assert logs(url, run_id, f"Worker '{worker_of(done[run_id])}' submitting flow run")
    windows = {i: work_window(url, done[i]) for i in ids}
    # (a) A's first run and B's ran at the same time, on different workers
    assert overlap(windows[a1], windows[b1]), windows
    # (b) A's two runs never touched the cluster at the same time, on different workers
    assert windows[a1][1] <= windows[a2][0], f"two runs of one cluster overlapped: {windows}"
    say(
        request,
        f"test_scale_out: B's run overlapped A's first by "
        f"{min(windows[a1][1], windows[b1][1]) - max(windows[a1][0], windows[b1][0]):.0f} s; "
        f"A's second began {windows[a2][0] - windows[a1][1]:.1f} s after A's first ended",
    )
    waited = logs(url, a2, f"waiting for {lock_name(cluster.name)}")
    assert waited or logs(url, a2, "holding the cluster after waiting"), "A2 never waited"


def tails(platform: Platform) -> str:
    return "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
        for p in sorted(platform.root.glob("*.log"))
    )


# --- (c) ------------------------------------------------------------------------------------------


def test_a_killed_worker_crashes_its_run_and_the_next_run_cleans_up(
    platform: Platform, request: pytest.FixtureRequest
) -> None:
    """SIGKILL to the worker whose run of A is loading weights. The run lives in a session of
    its own, but its output goes through the worker (the process worker's stream_output): its
    next line meets a closed pipe and it ends itself, Crashed, giving the cluster back on the
    way out. The next run of A, on the other worker, starts at once and replaces what the dead
    run left on the nodes."""
    url = platform.url
    if "w1" not in platform.workers:  # run alone (-k): the other test started it
        platform.start_worker("w1", limit=2)
    cluster = platform.clusters["a"]
    slow = cluster.write_config(
        platform.root / "scale-a-slow.toml",
        # a shard every 5 s, each logged by the run: it writes soon after its worker dies
        {"VRD_LOAD_SECONDS": "120", "VRD_SHARDS": "24"},
        # a holder that died without giving the cluster back keeps it until it has not beaten
        # for lease_s: a next run sooner than that shows the crash gave it back
        lease_s=LONG_LEASE_S,
    )
    a3 = platform.create_run("a", "manual", config_path=str(slow))
    eventually(lambda: logs(url, a3, "loading weights"), 150, "A's slow run loading", url, a3)
    (run,) = runs(url, [a3]).values()
    doomed = worker_of(run)
    survivor = next(name for name in platform.workers if name != doomed)
    left = {c["id"] for found in ours(cluster.bed, cluster.name).values() for c in found}
    assert left, "the slow run started nothing on the nodes"
    engine = flow_run_process(a3)

    worker = platform.workers.pop(doomed)
    os.killpg(worker.pid, signal.SIGKILL)  # the worker's process group: not its runs' sessions
    killed = time.time()
    worker.wait(10)
    a4 = platform.create_run("a", "nightly")
    found = wait_for(url, [a3, a4], lambda r: r["state_type"] in FINAL, 300, "after the kill")
    wait_until(lambda: not alive(engine), 30, "the dead worker's run process ending")
    crashed = stamp(found[a3]["end_time"])
    start, _ = work_window(url, found[a4])
    say(
        request,
        f"test_scale_out: the run Crashed {crashed - killed:.0f} s after its worker died; the "
        f"next run of A began {start - killed:.0f} s after it, waiting "
        f"{cluster_wait(url, a4):.0f} s for the cluster",
    )
    assert found[a3]["state_type"] == "CRASHED", found[a3]["state"]
    # by itself, not by the automation that crashes runs whose heartbeats stopped
    assert crashed - killed < SILENCE_S, (killed, found[a3]["state"])
    assert found[a4]["state_type"] == "COMPLETED", tails(platform)
    assert worker_of(found[a4]) == survivor
    # A4 began after the dead run's last step, and before that run's lease could have run out
    last = max(t for t, _ in logs(url, a3, "loading weights"))
    assert last < start < killed + LONG_LEASE_S / 4, (last, start, killed)
    assert_replaced(cluster, left, start)
    assert active_slots(url, lock_name(cluster.name)) == 0
    # no slot of the deployment's own to free: only the cluster's lock holds runs back
    deployment = api(url, "GET", f"/deployments/{cluster.deployments['manual']}")
    assert deployment["global_concurrency_limit"] is None


def flow_run_process(run_id: str) -> int:
    """The process of the flow run (`python -m prefect.engine`, told its run by variable)."""
    found = [
        p
        for p in pids_with_env(f"PREFECT__FLOW_RUN_ID={run_id}")
        if b"prefect.engine" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(found) == 1, found
    return found[0]


def cluster_wait(url: str, run_id: str) -> float:
    held = logs(url, run_id, "holding the cluster after waiting")
    return float(held[0][1].split("waiting ")[1].split(" s")[0]) if held else 0.0


def assert_replaced(cluster: Cluster, left: set[str], since: float) -> None:
    """One Ray container per node and one engine on the head, all the next run's, running;
    nothing of the dead run's group is left."""
    found = ours(cluster.bed, cluster.name)
    ray, engine = container_name(cluster.name, RAY_ROLE), container_name(cluster.name, ENGINE_ROLE)
    head, *others = (n.name for n in cluster.bed.nodes)
    assert sorted(c["name"] for c in found[head]) == [engine, ray], found
    for node in others:
        assert [c["name"] for c in found[node]] == [ray], found
    for c in itertools.chain.from_iterable(found.values()):
        assert c["status"] == "running" and c["id"] not in left, c
        assert stamp(c["created"].split(".")[0] + "+00:00") >= since - 1, (c, since)


def active_slots(url: str, name: str) -> int:
    return int(api(url, "GET", f"/v2/concurrency_limits/{name}")["active_slots"])
