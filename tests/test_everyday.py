"""The operator's everyday commands on a served group (vLLM's own launcher, two nodes): what a
person types by habit after `status`, as its own process, its output piped."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from deployments.event_sender import EventSender
from deployments.watcher import ClusterWatcher
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.testbed import image
from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]  # a bed and a flow run
CLI = Path(sys.executable).parent / "vllm-redeploy"
# Its own name: other modules' beds are all "bed" on the same Prefect server, and their runs
# (one a killed controller left Running) would be listed as this cluster's.
CLUSTER = "everyday"


@pytest.fixture(scope="module")
def served(prefect_api: str) -> Iterator[tuple[TestBed, Path]]:
    bed = make_bed(2, "h200", first_ip=145)
    try:
        for node in bed.nodes:  # a stranger's container: nothing here may touch it
            with contextlib.closing(node.engine.client()) as client:
                client.containers.run(
                    image.OLD_STACK_IMAGE, ["sleep", "999999"], name="canary", detach=True
                )
        path = bed.write_config(
            bed.root / "run.toml", name=CLUSTER, vllm={"env": {"VRD_LOAD_SECONDS": "1"}}
        )
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
        assert state.is_completed(), state.result(raise_on_failure=False)
        yield bed, path
    finally:
        bed.down()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=120, env=_plain_env()
    )


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}


def engine_id(bed: TestBed) -> str:
    with contextlib.closing(bed.nodes[0].engine.client()) as client:
        return str(client.containers.get(f"vllm-redeploy-{CLUSTER}-engine").id)


def by_source(text: str) -> dict[str, list[str]]:
    """Lines by their prefix ("node-1 leader"), prefix taken off."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        prefix, sep, rest = line.partition(" | ")
        assert sep, f"a line without its node and role: {line!r}"
        found.setdefault(prefix.strip(), []).append(rest)
    return found


def test_logs_of_every_member_prefixed_by_node_and_role(served: tuple[TestBed, Path]) -> None:
    _, path = served
    done = cli("logs", "-c", str(path))
    assert done.returncode == 0, done.stderr
    lines = by_source(done.stdout)
    assert list(lines) == ["node-2 follower", "node-1 leader"]  # the plan's order: phases
    assert all(0 < len(v) <= 100 for v in lines.values())  # --tail 100 by default
    assert any("vLLM API server version" in line for line in lines["node-1 leader"])
    assert any("rank 1" in line for line in lines["node-2 follower"]), lines["node-2 follower"]

    follower = cli("logs", "-c", str(path), "--role", "follower", "--tail", "3")
    assert follower.returncode == 0, follower.stderr
    assert list(by_source(follower.stdout)) == ["node-2 follower"]
    assert len(follower.stdout.splitlines()) == 3
    assert (
        follower.stdout.splitlines()
        == done.stdout.splitlines()[
            len(lines["node-2 follower"]) - 3 : len(lines["node-2 follower"])
        ]
    )
    head = cli("logs", "-c", str(path), "--node", "node-1", "--tail", "all")
    assert list(by_source(head.stdout)) == ["node-1 leader"]
    assert len(head.stdout.splitlines()) >= len(lines["node-1 leader"])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--role", "ray-worker"], "the group runs on mp, whose members are follower, leader"),
        (["--node", "node-9"], "--node node-9: not a node of"),
        (["--tail", "ten"], "--tail ten: give a number of lines, or all"),
        (["--since", "yesterday"], "--since yesterday: give a number with s, m, h or d"),
    ],
)
def test_logs_refuses_what_is_not_there_in_one_line(
    served: tuple[TestBed, Path], args: list[str], said: str
) -> None:
    _, path = served
    done = cli("logs", "-c", str(path), *args)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr


def test_logs_follow_prints_new_lines_as_they_come_until_interrupted(
    served: tuple[TestBed, Path],
) -> None:
    bed, path = served
    follow = subprocess.Popen(
        [str(CLI), "logs", "-c", str(path), "-f", "--tail", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_plain_env(),
        preexec_fn=_as_from_a_terminal,
    )
    seen: list[str] = []
    said: list[str] = []  # read as it comes: a full pipe would stop the command
    threading.Thread(target=lambda: seen.extend(follow.stdout), daemon=True).start()  # type: ignore[arg-type]
    reading = threading.Thread(target=lambda: said.extend(follow.stderr), daemon=True)  # type: ignore[arg-type]
    reading.start()
    try:
        # Followed once each member's last line came: the streams are open (a loaded machine
        # takes a while to start the CLI and reach both nodes).
        wait_for(lambda: {line.split(" | ")[0].strip() for line in seen} >= FOLLOWED, 120, seen)
        marker = uuid.uuid4().hex
        deadline = time.monotonic() + 60
        while not [line for line in seen if marker in line] and time.monotonic() < deadline:
            # a request the leader's access log records, with the marker in its request line
            httpx.get(f"http://{bed.nodes[0].ip}:30000/v1/models?seen={marker}", timeout=5)
            time.sleep(0.5)
        marked = [line for line in seen if marker in line]
        assert marked, seen
        assert marked[0].startswith("node-1 leader   | "), marked
    finally:
        follow.send_signal(signal.SIGINT)
        try:
            follow.wait(timeout=60)
        except subprocess.TimeoutExpired:
            masks = [
                line
                for line in Path(f"/proc/{follow.pid}/status").read_text().splitlines()
                if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
            ]
            follow.send_signal(signal.SIGUSR1)  # where its threads wait, on its stderr
            time.sleep(2)
            raise AssertionError(
                f"no exit 60 s after Ctrl-C ({', '.join(masks)}):\n" + "".join(said)[-6000:]
            ) from None
        finally:
            follow.kill()
    reading.join(10)  # to its end
    stderr = "".join(said)
    assert follow.returncode == 130 and "Traceback" not in stderr, stderr


FOLLOWED = {"node-1 leader", "node-2 follower"}


def _as_from_a_terminal() -> None:
    """Ctrl-C neither ignored nor blocked, as a shell starts a command: a child inherits both
    from this test process, where an earlier test of the worker may have changed them (a full
    run's CLI once sat 60 s after SIGINT, its main thread looping as it should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def wait_for(done: Callable[[], bool], seconds: float, what: object) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_run_on_a_paused_cluster_says_so_and_override_pause_runs_it(
    served: tuple[TestBed, Path],
) -> None:
    bed, path = served
    paused = cli("pause", "-c", str(path), "--reason", "reseating a cable", "--json")
    try:
        assert paused.returncode == 0, paused.stderr
        said = json.loads(paused.stdout)
        assert (said["cluster"], said["paused"]["reason"], said["runs"]) == (
            CLUSTER, "reseating a cable", [],
        )  # fmt: skip
        before = engine_id(bed)
        held = cli("run", "-c", str(path))
        assert held.returncode == 1, held.stderr[-2000:]
        assert held.stdout.startswith(f"flow run {CLUSTER}-manual-redeploy: http")
        assert "nothing was done (skipped: paused by" in " ".join(held.stderr.split())
        run = cli("run", "-c", str(path), "--override-pause", "--json")
        assert run.returncode == 0, run.stderr[-2000:]
        ran = json.loads(run.stdout)  # stdout holds the JSON alone; the steps went to stderr
        assert (ran["name"], ran["trigger"], ran["mode"], ran["state"], ran["action"]) == (
            f"{CLUSTER}-manual-redeploy", "manual", "redeploy", "Completed", "redeployed",
        )  # fmt: skip
        assert {"preflight", "wait-ready", "probe"} <= set(ran["steps"]), ran["steps"]
        assert ran["probe"]["healthy"] is True, ran["probe"]
        assert f"\nflow run {CLUSTER}-manual-redeploy: http" in run.stderr, run.stderr[:600]
        assert engine_id(bed) != before  # redeployed while paused, as asked
        assert "paused by" in cli("status", "-c", str(path)).stdout  # the pause stays
    finally:
        resumed = cli("resume", "-c", str(path), "--json")
        assert json.loads(resumed.stdout) == {"cluster": CLUSTER, "cleared": ["pause"]}


def test_runs_lists_the_last_runs_newest_first_with_why_and_where(
    served: tuple[TestBed, Path], prefect_api: str
) -> None:
    """The newest first, whatever ran before; a failed run's step and reason come through."""
    bed, path = served
    failing = bed.write_config(
        bed.root / "run.toml", name=CLUSTER, vllm={"env": {"VRD_FAULT": "empty"}}
    )
    assert failing == path  # the same cluster, the same file: a run that fails at the probe
    try:
        failed = cli("run", "-c", str(path), "--keep-on-failure", "--json")  # left up
        assert failed.returncode == 1, failed.stderr[-2000:]
    finally:
        bed.write_config(
            bed.root / "run.toml", name=CLUSTER, vllm={"env": {"VRD_LOAD_SECONDS": "1"}}
        )
    done = cli("runs", "-c", str(path), "--json", "-n", "2")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert len(listed) == 2
    newest = listed[0]
    assert (newest["name"], newest["trigger"], newest["mode"], newest["state"]) == (
        f"{CLUSTER}-manual-redeploy", "manual", "redeploy", "Failed",
    )  # fmt: skip
    assert newest["failure"].startswith("probe: the model answered but is not healthy: empty"), (
        newest
    )
    assert (
        newest["url"]
        == f"{prefect_api.removesuffix('/api')}/runs/flow-run/" + newest["url"].rsplit("/", 1)[1]
    )
    assert newest["seconds"] > 0
    # `run --json` said the same of it as `runs --json` says, and that it did nothing to show.
    assert json.loads(failed.stdout) == {**newest, "action": None, "steps": None, "probe": None}
    started = [run["started"] for run in listed]
    assert started == sorted(started, reverse=True)
    assert all(run["failure"] == "" for run in listed if run["state"] != "Failed")
    piped = cli("runs", "-c", str(path), "-n", "2").stdout.splitlines()
    assert len(piped) == 2
    assert re.fullmatch(
        r"\d\d-\d\d \d\d:\d\d:\d\d "
        + CLUSTER
        + r"-manual-redeploy \(manual, redeploy\): Failed after \d+ s: "
        r"probe: the model answered but is not healthy: .*  " + re.escape(newest["url"]),
        piped[0],
    ), piped[0]


def test_stop_removes_the_group_proves_it_gone_and_with_pause_the_watcher_leaves_it_down(
    served: tuple[TestBed, Path], prefect_api: str
) -> None:
    """Last in this module: it leaves the group down (the rows above need it served)."""
    bed, path = served
    done = cli("stop", "-c", str(path), "--pause", "--reason", "moving the rack")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{CLUSTER}: paused by ") and lines[0].endswith("moving the rack")
    assert lines[1].startswith(f"flow run {CLUSTER}-manual-stop: http")
    assert [line.split(":")[0] for line in lines[2:6]] == [
        "guard", "cluster-lock", "stop-group", "gpus-clear",
    ]  # fmt: skip
    assert f"# {CLUSTER}: stopped" in done.stdout
    assert f"node-1: removed vllm-redeploy-{CLUSTER}-engine" in done.stdout
    assert f"node-2: removed vllm-redeploy-{CLUSTER}-follower" in done.stdout
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            assert (
                client.containers.list(
                    all=True, filters={"label": f"io.vllm-redeploy.cluster={CLUSTER}"}
                )
                == []
            )
            assert client.containers.get("canary")  # not ours: left alone
    status = cli("status", "-c", str(path))
    assert (
        status.returncode == 1
        and "paused by" in status.stdout
        and "moving the rack" in status.stdout
    )
    # The watcher's looks find it down, and paused: it tells Prefect nothing (no recovery).
    watched = bed.write_config(bed.root / "watched.toml", name=CLUSTER, watch={"failures": 1})
    sender = EventSender(prefect_api)
    watcher = ClusterWatcher(load_config(watched, env_file=None), sender)
    for _ in range(3):
        watcher.look_once()
    sender.close()
    assert not watcher.state.reported and sender.sent == 0  # unpaused, failures=1 reports
    assert cli("resume", "-c", str(path)).returncode == 0
