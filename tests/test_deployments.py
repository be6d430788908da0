"""Deployments against a real `prefect server start`: prefect.yaml, `serve`, the reboot trigger."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments.definitions import deployment_specs, nightly_schedules
from deployments.event_sender import EventSender
from deployments.webhook import running_webhook, sign
from tests.conftest import make_bed
from tests.testbed.bed import TestBed
from tests.testbed.procs import spawn, stop
from vllm_redeploy.config import load_config
from vllm_redeploy.config.runs import ScheduleConfig
from vllm_redeploy.events import cluster_rebooted_event

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def api(url: str, method: str, path: str, body: Any = None) -> Any:
    """One call to the Prefect API; a 503 (its database busy, under the suite's load) is asked
    again, as Prefect's own client does."""
    for attempt in range(5):
        response = httpx.request(method, f"{url}{path}", json=body, timeout=30)
        if response.status_code != 503 or attempt == 4:
            break
        time.sleep(1 + attempt)
    response.raise_for_status()
    return response.json() if response.content else None


def deployments_by_name(url: str) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in api(url, "POST", "/deployments/filter", {})}


def test_prefect_yaml_registers_four_deployments(prefect_api: str, tmp_path: Path) -> None:
    cluster = f"yaml{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "VLLM_REDEPLOY_CLUSTER": cluster,
        "VLLM_REDEPLOY_CONFIG": str(tmp_path / "cluster.toml"),
        "VLLM_REDEPLOY_HOME": str(REPO),
    }
    subprocess.run(
        [
            str(BIN / "prefect"),
            "work-pool",
            "create",
            "vllm-redeploy",
            "--type",
            "process",
            "--overwrite",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    done = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", "deploy", "--all"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = deployments_by_name(prefect_api)
    names = {f"{cluster}-{kind}" for kind in ("nightly", "after-reboot", "recover", "manual")}
    assert names <= set(found)
    for name in names:
        d = found[name]
        assert d["work_pool_name"] == "vllm-redeploy"
        # No limit of Prefect's own (whose lost lease cancels a run mid-load): the cluster's
        # lock runs one run at a time.
        assert d["global_concurrency_limit"] is None
        assert d["parameters"]["config_path"] == str(tmp_path / "cluster.toml")
    (nightly,) = found[f"{cluster}-nightly"]["schedules"]
    assert nightly["schedule"]["cron"] == "0 4 * * *" and nightly["schedule"]["timezone"] == "UTC"
    assert nightly["slug"] == "nightly" and nightly["active"]
    assert found[f"{cluster}-nightly"]["parameters"]["mode"] == "redeploy"
    assert not found[f"{cluster}-manual"]["schedules"]
    assert {found[n]["parameters"]["trigger"] for n in names} == {
        "nightly",
        "after-reboot",
        "recover",
        "manual",
    }
    automations = api(prefect_api, "POST", "/automations/filter", {})
    triggers = {
        a["trigger"]["expect"][0]: a["trigger"]
        for a in automations
        if a["trigger"].get("match", {}).get("vllm-redeploy.cluster") == cluster
    }
    assert set(triggers) == {"vllm.cluster.rebooted", "vllm.cluster.unhealthy"}
    reboot = triggers["vllm.cluster.rebooted"]
    assert reboot["posture"] == "Reactive" and (reboot["threshold"], reboot["within"]) == (1, 600.0)
    assert triggers["vllm.cluster.unhealthy"]["threshold"] == 1


def test_serve_and_prefect_yaml_declare_the_same_deployments() -> None:
    config = load_config(REPO / "cluster.example.toml", env_file=None)
    specs = {
        s["name"].removeprefix(f"{config.name}-"): s
        for s in deployment_specs(config, REPO / "cluster.example.toml")
    }
    declared = {
        d["name"].split("}}-")[-1]: d
        for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    }
    assert set(specs) == set(declared) == {"nightly", "after-reboot", "recover", "manual"}
    for kind, spec in specs.items():
        assert spec["parameters"]["mode"] == declared[kind]["parameters"]["mode"]
        assert spec["parameters"]["trigger"] == declared[kind]["parameters"]["trigger"] == kind
        assert "concurrency_limit" not in spec and "concurrency_limit" not in declared[kind]
    (schedule,) = specs["nightly"]["schedules"]
    (yaml_schedule,) = declared["nightly"]["schedules"]
    assert (schedule.cron, schedule.timezone) == (yaml_schedule["cron"], yaml_schedule["timezone"])
    (trigger,) = specs["after-reboot"]["triggers"]
    # A cluster's own [schedule], or none.
    weekdays = config.model_copy(
        update={"schedule": ScheduleConfig(nightly="30 2 * * 1-5", timezone="Europe/Berlin")}
    )
    (mine,) = nightly_schedules(weekdays)
    assert (mine.cron, mine.timezone) == ("30 2 * * 1-5", "Europe/Berlin")
    assert (
        nightly_schedules(config.model_copy(update={"schedule": ScheduleConfig(nightly="off")}))
        == []
    )
    (yaml_trigger,) = declared["after-reboot"]["triggers"]
    assert trigger.within.total_seconds() == yaml_trigger["within"]
    assert trigger.expect == set(yaml_trigger["expect"]) == {"vllm.cluster.rebooted"}
    assert trigger.schedule_after.total_seconds() == yaml_trigger.get("schedule_after", 0) == 0


# --- the reboot trigger end to end: signed webhook calls -> events -> one run, by `serve` ---

SECRET = "test-webhook-secret-" + uuid.uuid4().hex
REBOOT_DELAY_S = 600


@pytest.fixture(scope="module")
def served(
    prefect_api: str, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[tuple[TestBed, Path, str]]:
    monkeypatch_module.setenv("VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET", SECRET)
    bed = make_bed(2, "h200", first_ip=81)
    proc = None
    sender = EventSender(prefect_api)
    try:
        path = bed.write_config(
            bed.root / "served.toml",
            name=f"srv{uuid.uuid4().hex[:6]}",
            vllm={"env": {"VRD_LOAD_SECONDS": "1"}},
            # A delay no run here waits out: the run starts when both nodes have reported.
            webhook={"reboot_debounce_s": 120, "reboot_delay_s": REBOOT_DELAY_S},
            schedule={"nightly": "30 2 * * 1-5", "timezone": "Europe/Berlin"},
        )
        config = load_config(path, env_file=None)
        env = {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        proc = spawn(
            [str(BIN / "vllm-redeploy"), "serve", "--config", str(path)],
            bed.root / "serve.log",
            env,
        )
        deadline = time.monotonic() + 60
        while f"{config.name}-after-reboot" not in deployments_by_name(prefect_api):
            assert time.monotonic() < deadline, (bed.root / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        with running_webhook(config, sender) as url:
            yield bed, path, url
    finally:
        sender.close(timeout=10)
        if proc is not None:
            stop(proc, grace=10)
        bed.down()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def call(
    url: str,
    node: str,
    boot_id: str,
    secret: str = SECRET,
    stamp: int | None = None,
    body: bytes | None = None,
    signed: bool = True,
) -> httpx.Response:
    body = body or json.dumps({"node": node, "boot_id": boot_id, "uptime_s": 9.5}).encode()
    stamp = int(time.time()) if stamp is None else stamp
    headers = {"Content-Type": "application/json"}
    if signed:
        headers |= {
            "X-Vllm-Redeploy-Timestamp": str(stamp),
            "X-Vllm-Redeploy-Signature": sign(secret, stamp, body),
        }
    return httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)


def runs_of(url: str, deployment_id: str) -> list[dict[str, Any]]:
    return api(
        url,
        "POST",
        "/flow_runs/filter",
        {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}},
    )


def wait_for_runs(url: str, deployment_id: str, count: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        runs = runs_of(url, deployment_id)
        final = [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
        if len(final) >= count:
            return runs
        assert time.monotonic() < deadline, [(r["name"], r["state_type"]) for r in runs]
        time.sleep(1)


def after_reboot(url: str, path: Path) -> dict[str, Any]:
    config = load_config(path, env_file=None)
    return deployments_by_name(url)[f"{config.name}-after-reboot"]


def test_serve_registers_the_clusters_own_schedule(
    prefect_api: str, served: tuple[TestBed, Path, str]
) -> None:
    config = load_config(served[1], env_file=None)
    (nightly,) = deployments_by_name(prefect_api)[f"{config.name}-nightly"]["schedules"]
    assert (nightly["schedule"]["cron"], nightly["schedule"]["timezone"]) == (
        "30 2 * * 1-5",
        "Europe/Berlin",
    )
    assert nightly["active"]


def test_bad_calls_start_no_run(prefect_api: str, served: tuple[TestBed, Path, str]) -> None:
    _, path, url = served
    deployment = after_reboot(prefect_api, path)
    boot = str(uuid.uuid4())
    assert call(url, "node-1", boot, signed=False).status_code == 401
    assert call(url, "node-1", boot, secret="forged-secret-forged").status_code == 401
    assert call(url, "node-1", boot, stamp=int(time.time()) - 3600).status_code == 401  # replay
    assert call(url, "node-1", boot, body=b"{" + b" " * 10_000 + b"}").status_code == 413
    assert call(url, "not-a-node", boot).status_code == 400
    time.sleep(8)  # the server persists events every few seconds; triggers act on them
    assert runs_of(prefect_api, deployment["id"]) == []


def test_two_node_reboots_lead_to_one_redeploy_once_both_reported(
    prefect_api: str, served: tuple[TestBed, Path, str]
) -> None:
    bed, path, url = served
    deployment = after_reboot(prefect_api, path)
    sent = []
    for node in bed.nodes:
        bed.reboot(node.name)
        boot_id = node.boot_id_file.read_text().strip()
        for _ in range(2):  # a notifier retrying the same boot
            assert call(url, node.name, boot_id).status_code == 202
        sent.append(time.time())
        time.sleep(2)
    runs = wait_for_runs(prefect_api, deployment["id"], 1, timeout=150)
    time.sleep(5)  # a second run would have been created by now
    runs = runs_of(prefect_api, deployment["id"])
    assert len(runs) == 1, [(r["name"], r["state_type"]) for r in runs]
    assert runs[0]["state_type"] == "COMPLETED" and runs[0]["parameters"]["mode"] == "ensure"
    # named when it started, as the UI lists it: cluster, trigger, mode
    assert runs[0]["name"] == f"{load_config(path, env_file=None).name}-after-reboot-ensure"
    started = datetime.fromisoformat(runs[0]["start_time"]).timestamp()
    # Started on the second node's report, not reboot_delay_s after the first one's.
    assert started < sent[0] + REBOOT_DELAY_S
    print(f"last node's signed call -> flow run Running: {started - sent[-1]:.1f} s")


def test_calls_for_another_cluster_start_nothing(
    prefect_api: str, served: tuple[TestBed, Path, str]
) -> None:
    _, path, _ = served
    deployment = after_reboot(prefect_api, path)
    before = len(runs_of(prefect_api, deployment["id"]))
    config = load_config(path, env_file=None)
    # Another cluster's nodes all came back: that cluster's after-reboot event, not this one's.
    event = cluster_rebooted_event("other", {"node-1": str(uuid.uuid4())}, [], 1.0)
    api(prefect_api, "POST", "/events", [event])
    time.sleep(8)
    assert len(runs_of(prefect_api, deployment["id"])) == before
    assert config.name != "other"


# --- a deployment's run uses the configuration `serve` was started with (issue 34) ----------


class Knocks:
    """A node's SSH port that counts who connects: a run that reaches for the node knocks."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.count = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def cluster_file(path: Path, name: str, port: int) -> Path:
    """A one-node cluster whose node is a Knocks port (no sshd there: a run fails at preflight)."""
    known_hosts = path.parent / "known_hosts"
    known_hosts.touch()
    path.write_text(
        f'name = "{name}"\n'
        '[[nodes]]\nname = "node-1"\naddress = "127.0.0.1"\n'
        f'ssh_port = {port}\nssh_user = "nobody"\n'
        f'[ssh]\nknown_hosts = "{known_hosts}"\nconnect_timeout_s = 2\n'
        '[vllm]\nimage = "vllm/vllm-openai:v0.19.0"\nmodel = "/models/m"\n'
        "[deadlines]\nnodes_reachable_s = 2\n"
    )
    return path


def final_run(url: str, run_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        run = api(url, "GET", f"/flow_runs/{run_id}")
        if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        assert time.monotonic() < deadline, (run["name"], run["state_type"])
        time.sleep(1)


def test_a_deployment_run_naming_another_toml_is_refused_before_any_node_is_touched(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A click in the UI that points the manual deployment at another TOML (with its own nodes
    and secrets) fails at step config, touching no node; the file serve was started with, however
    it is spelled, is run. Called directly (`vllm-redeploy run --config`), any file is run."""
    ours, theirs = Knocks(), Knocks()
    served = cluster_file(tmp_path / "served.toml", f"cfg{uuid.uuid4().hex[:6]}", ours.port)
    other = cluster_file(tmp_path / "other.toml", f"oth{uuid.uuid4().hex[:6]}", theirs.port)
    (tmp_path / "other.env").write_text("VLLM_REDEPLOY_SECRETS__HF_TOKEN=hf_" + "o" * 30 + "\n")
    name = load_config(served, env_file=None).name
    env = {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = tmp_path / "serve.log"
    proc = spawn([str(BIN / "vllm-redeploy"), "serve", "--config", str(served)], log, env)
    try:
        deadline = time.monotonic() + 60
        while f"{name}-manual" not in deployments_by_name(prefect_api):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        manual = deployments_by_name(prefect_api)[f"{name}-manual"]
        assert manual["parameters"]["config_path"] == str(served.resolve())

        def start(config_path: Path) -> str:
            body = {"parameters": {"config_path": str(config_path), "mode": "ensure"}}
            return api(prefect_api, "POST", f"/deployments/{manual['id']}/create_flow_run", body)[
                "id"
            ]

        refused = final_run(prefect_api, start(other), 120)
        message = refused["state"]["message"]
        assert refused["state_type"] == "FAILED", message
        assert "config: deployment" in message and f"refuses config_path {other}" in message
        assert f"started with ({served.resolve()})" in message
        tasks = api(
            prefect_api,
            "POST",
            "/task_runs/filter",
            {"task_runs": {"flow_run_id": {"any_": [refused["id"]]}}},
        )
        assert tasks == []  # not even the guard ran
        assert (ours.count, theirs.count) == (0, 0)

        link = tmp_path / "link.toml"  # the same file by another name: the deployment's own
        link.symlink_to(served)
        same = final_run(prefect_api, start(link), 180)
        assert "StepFailed: preflight: node node-1" in same["state"]["message"]  # past config
        assert ours.count > 0 and theirs.count == 0  # it went on to the node
    finally:
        stop(proc, grace=10)
        ours.close()
    # The CLI's way, the flow called directly: the file it names, whatever the process serves.
    from flows.redeploy import redeploy_vllm_cluster

    monkeypatch.setenv("VLLM_REDEPLOY_CONFIG", str(served))
    state = redeploy_vllm_cluster(str(other), "ensure", return_state=True)
    theirs.close()
    assert state.is_failed() and "StepFailed: preflight: node node-1" in str(state.message)
    assert theirs.count > 0


# --- `vllm-redeploy doctor` on this controller: the server, serve, the webhook, two nodes ---


def test_doctor_reads_the_controller_and_names_the_one_problem_planted(
    prefect_api: str, served: tuple[TestBed, Path, str]
) -> None:
    """Last in this module (a notifier installed on node-1 would speak at its reboots). Planted:
    node-2 has no notifier. Everything else is well: the API, the four deployments served, the
    key and known_hosts, the webhook, reached from both nodes, the clocks."""
    from typer.testing import CliRunner

    from deployments.cli import app
    from deployments.cli.prefect_api import talking_to
    from deployments.install_notifier import install_notifier
    from deployments.watcher import watch_clusters
    from tasks.standing.marks import watcher_beat

    bed, path, url = served
    name = load_config(path, env_file=None).name
    doctored = bed.write_config(bed.root / f"{name}.toml", name=name, webhook={"url": url})
    config = load_config(doctored, env_file=None)
    install_notifier(config, "node-1")
    stopped = threading.Event()  # the real watcher, its threads told the API as `watch` tells them
    looker = threading.Thread(target=watch_clusters, args=([config], stopped))
    with talking_to({"PREFECT_API_URL": prefect_api}):
        looker.start()
        try:
            deadline = time.monotonic() + 60
            while watcher_beat(name) is None:
                assert time.monotonic() < deadline, "the watcher never said it looks"
                time.sleep(0.5)
        finally:
            stopped.set()
            looker.join(60)
    done = CliRunner().invoke(app, ["doctor", "-c", str(doctored), "--json"])
    assert done.exit_code == 1, done.output
    findings = json.loads(done.output)
    wrong = [f for f in findings if not f["ok"]]
    assert [(f["area"], f["said"]) for f in wrong] == [
        ("node-2", "notifier not installed (notify.py, vllm-redeploy-notify.service, "
         "notifier.env, notifier.secret missing)"),
    ], wrong  # fmt: skip
    assert wrong[0]["fix"] == "`vllm-redeploy install-notifier node-2 -c FILE`"
    said = {(f["area"], f["said"]) for f in findings}
    assert ("deployments", "nightly, after-reboot, recover, manual: registered and served") in said
    assert ("node-1", "notifier installed, current and enabled") in said
    assert ("node-2", f"reaches the webhook ({url}/healthz)") in said
    assert any(area == "prefect api" and s.endswith(" answers") for area, s in said)
    assert any(area == "watcher" and s.startswith("last word ") for area, s in said), said
    (lock,) = [s for area, s in said if area == "lock"]
    assert lock.startswith("free; leases in the server's memory"), lock  # the run released it

    screen = CliRunner().invoke(app, ["doctor", "-c", str(doctored)], terminal_width=200)
    assert screen.exit_code == 1 and f"cluster {name}: 1 problem" in screen.output
    assert "fix: `vllm-redeploy install-notifier node-2 -c FILE`" in screen.output

    # A second problem planted: the cluster's lock disabled (by hand, in the UI) enforces nothing.
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from vllm_redeploy.names import lock_name

    with talking_to({"PREFECT_API_URL": prefect_api}), get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(
            lock_name(name), GlobalConcurrencyLimitUpdate(active=False)
        )
    done = CliRunner().invoke(app, ["doctor", "-c", str(doctored), "--json"])
    (lock,) = [f for f in json.loads(done.output) if f["area"] == "lock"]
    assert not lock["ok"] and lock["said"].endswith(
        "is disabled: two runs could change the nodes together"
    )
    assert lock["fix"].startswith(f"`prefect gcl update {lock_name(name)} --limit 1 --enable`")
