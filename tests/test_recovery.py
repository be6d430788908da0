"""Kept up between runs (issue 16): `vllm-redeploy watch` and `serve` against the session's real
Prefect server, on a bed whose engine is killed, whose worker loses its Ray container, whose model
crash-loops, and which is paused for maintenance. The intervals are the configuration's, short."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.test_deployments import api, deployments_by_name
from tests.testbed.bed import SERVED_NAME, TestBed
from tests.testbed.procs import spawn, stop, wait_until
from vllm_redeploy.events import cluster_rebooted_event
from vllm_redeploy.probe import run_probe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
BIN = Path(sys.executable).parent
WATCH = {"interval_s": 1, "failures": 2, "max_recoveries": 2, "window_s": 900, "backoff_s": 4}


@dataclass
class Controller:
    """The bed, its configuration, and the controller's two processes: `serve` and `watch`."""

    bed: TestBed
    path: Path
    cluster: str
    api: str
    procs: dict[str, subprocess.Popen[bytes]]

    def start(self, *which: str) -> None:
        env = {"PREFECT_API_URL": self.api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        for name in which or ("serve", "watch"):
            argv = [str(BIN / "vllm-redeploy"), name, "--config", str(self.path)]
            self.procs[name] = spawn(argv, self.bed.root / f"{name}.log", env)
        wait_until(
            lambda: f"{self.cluster}-recover" in deployments_by_name(self.api),
            60,
            "serve's deployments",
            self.bed.root / "serve.log",
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc, grace=10)
        self.procs.clear()

    def write(self, **vllm_env: str) -> None:
        self.bed.write_config(
            self.path, name=self.cluster, vllm={"env": {"VRD_LOAD_SECONDS": "2", **vllm_env}},
            watch=WATCH, webhook={"reboot_delay_s": 0},
        )  # fmt: skip

    def cli(self, *args: str, check: bool = True) -> str:
        env = {"PREFECT_API_URL": self.api, "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [str(BIN / "vllm-redeploy"), *args, "-c", str(self.path)],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
        assert done.returncode == 0 or not check, done.stderr
        return done.stdout

    def runs(self, kind: str) -> list[dict[str, Any]]:
        deployment = deployments_by_name(self.api)[f"{self.cluster}-{kind}"]
        body = {
            "flow_runs": {"deployment_id": {"any_": [deployment["id"]]}},
            "sort": "START_TIME_ASC",
        }
        return api(self.api, "POST", "/flow_runs/filter", body)

    def events(self, name: str) -> list[dict[str, Any]]:
        body = {
            "filter": {
                "event": {"name": [name]},
                "resource": {"id": [f"vllm-redeploy.cluster.{self.cluster}"]},
                "occurred": {"since": "2020-01-01T00:00:00Z"},
            },
            "limit": 50,
        }
        return api(self.api, "POST", "/events/filter", body)["events"]

    def served(self) -> bool:
        head = self.bed.nodes[0]
        return run_probe(f"http://{head.ip}:30000", SERVED_NAME, "Hi.", 50, 0.0, 5).healthy

    def container(self, node: int, role: str) -> Any:
        with contextlib.closing(self.bed.nodes[node].engine.client()) as client:
            return client.containers.get(f"vllm-redeploy-{self.cluster}-{role}")


@pytest.fixture(scope="module")
def controller(prefect_api: str) -> Iterator[Controller]:
    bed = make_bed(2, "h200", first_ip=71, backend="ray")  # a row loses a Ray container
    ctl = Controller(bed, bed.root / "watched.toml", f"kept{uuid.uuid4().hex[:6]}", prefect_api, {})
    ctl.write()
    try:
        state = redeploy_vllm_cluster(str(ctl.path), "redeploy", return_state=True)
        assert state.is_completed(), state.result(raise_on_failure=False)
        ctl.start()
        yield ctl
    finally:
        ctl.stop()
        for log in bed.root.glob("*.log"):  # what serve and watch said, for whoever debugs
            print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-200:]))
        bed.down()


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    context: Callable[[], str] = lambda: "",
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s {context()}"
        time.sleep(0.5)


def ended(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs in a final state."""
    return [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]


def brief(runs: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Each run's name, state, times and message's start: what an assertion shows."""
    return [(r["name"], r["state_name"], r["start_time"] or "-", r["end_time"] or "-",
             (r["state"]["message"] or "")[:120]) for r in runs]  # fmt: skip


def under_way(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["state_type"] in ("SCHEDULED", "PENDING", "RUNNING")]


def running(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["state_type"] == "RUNNING"]


def finished(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that acted and ended (a Skipped or Unchanged run did not act)."""
    return [r for r in ended(runs) if r["state_name"] not in ("Skipped", "Unchanged")]


def test_a_healthy_cluster_gets_no_event_and_no_run(controller: Controller) -> None:
    time.sleep(8)  # eight looks
    assert controller.events("vllm.cluster.unhealthy") == []
    assert controller.runs("recover") == []


def test_the_engine_killed_is_served_again_without_a_person(controller: Controller) -> None:
    controller.container(0, "engine").kill()
    killed = time.monotonic()
    event = wait_for(lambda: controller.events("vllm.cluster.unhealthy"), 60, "unhealthy event")
    noticed = time.monotonic() - killed
    assert "the vLLM engine on node-1 is not running" in event[0]["payload"]["problems"]
    (run,) = wait_for(lambda: finished(controller.runs("recover")), 180, "the recovery run")
    assert run["state_type"] == "COMPLETED" and run["state_name"] == "Completed", run
    assert controller.served()
    print(
        f"engine killed -> unhealthy {noticed:.1f} s, -> served {time.monotonic() - killed:.1f} s"
    )


def test_a_worker_losing_its_ray_container_gets_the_whole_group_redeployed(
    controller: Controller,
) -> None:
    before = {n: controller.container(n, "ray").id for n in (0, 1)}
    engine_before = controller.container(0, "engine").id
    controller.container(1, "ray").remove(force=True)
    wait_for(lambda: len(finished(controller.runs("recover"))) >= 2, 180, "the second recovery")
    assert finished(controller.runs("recover"))[-1]["state_type"] == "COMPLETED"
    after = {n: controller.container(n, "ray").id for n in (0, 1)}
    assert all(after[n] != before[n] for n in (0, 1))  # the group, not only node-2
    assert controller.container(0, "engine").id != engine_before and controller.served()


def test_paused_nothing_happens_and_resume_brings_it_back(controller: Controller) -> None:
    runs_before = len(controller.runs("recover"))
    said = controller.cli("pause", "--reason", "changing the fabric cables")
    assert "paused by " in said and "changing the fabric cables" in said
    controller.container(0, "engine").kill()
    # What the webhook emits once the nodes reported their new boots (deployments/reboot_rounds)
    boots = {node.name: str(uuid.uuid4()) for node in controller.bed.nodes}
    api(
        controller.api,
        "POST",
        "/events",
        [cluster_rebooted_event(controller.cluster, boots, [], 1.0)],
    )
    reboot_runs = wait_for(
        lambda: ended(controller.runs("after-reboot")),
        120,
        "the reboot's run",
        lambda: f"after-reboot runs: {[r['state_name'] for r in controller.runs('after-reboot')]}",
    )
    (skipped,) = reboot_runs
    assert skipped["state_name"] == "Skipped", skipped
    assert "changing the fabric cables" in skipped["state"]["message"]
    assert "paused by " in skipped["state"]["message"]
    time.sleep(5)
    assert len(controller.runs("recover")) == runs_before  # the watcher held back
    assert controller.container(0, "engine").status == "exited"  # nothing replaced it
    status = subprocess.run(
        [str(BIN / "vllm-redeploy"), "status", "-c", str(controller.path)],
        capture_output=True, text=True, timeout=90,
        env={"PREFECT_API_URL": controller.api, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert status.stdout.splitlines()[1].startswith("paused by "), status.stdout[:300]
    assert "cleared pause" in controller.cli("resume")
    wait_for(lambda: len(finished(controller.runs("recover"))) > runs_before, 180, "recovery")
    assert finished(controller.runs("recover"))[-1]["state_type"] == "COMPLETED"
    assert controller.served()


def test_a_model_that_crashes_at_every_start_stops_being_retried(controller: Controller) -> None:
    """max_recoveries (2) recovery runs act, spaced by the backoff, one crashloop event, no more;
    the count is Prefect's: restarting `serve` and `watch` between the two changes nothing. A
    second recovery of the cluster while the first runs changes nothing."""
    controller.cli(
        "resume"
    )  # a person's resume: the recoveries of the tests before no longer count
    acted_before = len(finished(controller.runs("recover")))
    controller.write(VRD_FAULT="crash_during_load")
    controller.container(0, "engine").kill()
    (first,) = wait_for(lambda: running(controller.runs("recover")), 60, "the first recovery")
    again = redeploy_vllm_cluster(str(controller.path), "ensure", trigger="recover",
                                  return_state=True)  # fmt: skip
    assert again.name == "Skipped", again
    assert f"recovery {first['name']} is under way" in (again.message or ""), again.message
    assert running(controller.runs("recover")), "the first ended before the second looked"
    wait_for(lambda: finished(controller.runs("recover"))[acted_before:], 180, "the first recovery")
    runs = controller.runs("recover")
    assert [r["state_type"] for r in finished(runs)[acted_before:]] == ["FAILED"], brief(runs)
    controller.stop()  # the controller restarts between the two recoveries
    controller.start()
    crashloops = wait_for(lambda: controller.events("vllm.cluster.crashloop"), 240, "crashloop")
    wait_for(lambda: not under_way(controller.runs("recover")), 120, "the runs to end")
    settled = len(controller.runs("recover"))
    time.sleep(10)  # nothing more happens
    assert len(controller.runs("recover")) == settled  # not even a skipped one
    acted = finished(controller.runs("recover"))[acted_before:]
    assert [r["state_type"] for r in acted] == ["FAILED", "FAILED"], acted
    assert len(controller.events("vllm.cluster.crashloop")) == len(crashloops) == 1
    gap = (
        datetime.fromisoformat(acted[1]["start_time"])
        - datetime.fromisoformat(acted[0]["end_time"])
    ).total_seconds()
    assert gap >= WATCH["backoff_s"] - 1, gap
    assert "crash-looping since " in controller.cli("status", check=False)  # exit 1: unhealthy
    # A person fixes the model and resumes: recovered.
    controller.write()
    assert "cleared crashloop" in controller.cli("resume")
    wait_for(controller.served, 180, "the model back after resume")
