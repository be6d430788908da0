"""Secrets never leak: the HF token, the webhook secret and the SSH key's passphrase, set the way
an operator sets them (environment), through a successful and a failed redeploy on the test bed
with a real Prefect server.

Searched for each secret: every log line of both flow runs, every artifact (the summaries and the
diagnostics), the flow and task runs as the API returns them, every Prefect event of this module's
time, the Prefect server's database and log files, this process's persisted results, the failure
message, the `check-config` and `run --dry-run` output of real processes, and the command line of
every process on this machine (the bed's nodes are processes here) while the engine serves.
Each search proves its subject was real and the secret was in play, so that it can fail."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import paramiko
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config
from vllm_redeploy.launch.group import engine_container
from vllm_redeploy.nodes import NodeAccess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CLI = Path(sys.executable).parent / "vllm-redeploy"
SECRETS = {
    "hf_token": f"hf_VrdLeakCheck{uuid.uuid4().hex}",
    "webhook_secret": f"whsec-VrdLeakCheck-{uuid.uuid4().hex}",
    "key_passphrase": f"pp-VrdLeakCheck-{uuid.uuid4().hex}",
}
ENV = {
    "VLLM_REDEPLOY_SECRETS__HF_TOKEN": SECRETS["hf_token"],
    "VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET": SECRETS["webhook_secret"],
    "VLLM_REDEPLOY_SSH__KEY_PASSPHRASE": SECRETS["key_passphrase"],
}


def leaks(text: str | bytes) -> list[str]:
    """The names of the secrets that appear in ``text``."""
    data = text.encode("utf-8", "replace") if isinstance(text, str) else text
    return [name for name, value in SECRETS.items() if value.encode() in data]


@dataclass
class ProcessScan:
    """Every process's command line, read while the engine served."""

    cmdlines: dict[int, bytes] = field(default_factory=dict)
    engine_pid: int = 0
    engine_cmdline: bytes = b""
    engine_environ: bytes = b""
    ps_over_ssh: str = ""


@dataclass
class Runs:
    bed: TestBed
    config_path: Path
    cluster: str
    started: datetime
    ok: Any  # the successful run's final state
    failed: Any  # the failed run's final state
    scan: ProcessScan
    prefect_home: Path
    encrypted_key: Path


def _cmdlines() -> dict[int, bytes]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                found[int(entry.name)] = (entry / "cmdline").read_bytes()
    return found


def _scan_processes(bed: TestBed, cluster: str, config_path: Path) -> ProcessScan:
    scan = ProcessScan(cmdlines=_cmdlines())
    with contextlib.closing(bed.nodes[0].engine.client()) as client:
        container = client.containers.get(f"vllm-redeploy-{cluster}-engine")
        scan.engine_pid = int(container.attrs["State"]["Pid"])
    scan.engine_cmdline = Path(f"/proc/{scan.engine_pid}/cmdline").read_bytes()
    scan.engine_environ = Path(f"/proc/{scan.engine_pid}/environ").read_bytes()
    config = load_config(config_path, env_file=None)  # the passphrase comes from ENV
    with NodeAccess(config.nodes[0], config) as access:
        scan.ps_over_ssh = access.runner.run(["ps", "-eww", "-o", "pid=,args="], timeout=30).stdout
    return scan


@pytest.fixture(scope="module")
def runs(prefect_api: str, workdir: Path) -> Iterator[Runs]:
    started = datetime.now(UTC) - timedelta(seconds=5)
    bed = make_bed(2, "h200", first_ip=141)
    try:
        # A passphrase-protected copy of the controller's key (the same key pair, so the nodes
        # accept it); without the passphrase from the environment no node can be reached.
        encrypted = bed.root / "id_controller_encrypted"
        shutil.copy(bed.client_key, encrypted)
        encrypted.chmod(0o600)
        subprocess.run(
            ["ssh-keygen", "-q", "-p", "-P", "", "-N", SECRETS["key_passphrase"], "-f", encrypted],
            check=True,
            capture_output=True,
        )
        cluster = f"sec{uuid.uuid4().hex[:6]}"
        path = bed.root / "secrets.toml"
        common: dict[str, Any] = {"name": cluster, "ssh": {"key_file": str(encrypted)}}
        with pytest.MonkeyPatch.context() as env:
            for key, value in ENV.items():
                env.setenv(key, value)
            bed.write_config(path, vllm={"env": {"VRD_LOAD_SECONDS": "1"}}, **common)
            ok = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
            assert ok.is_completed(), ok.result(raise_on_failure=False)
            scan = _scan_processes(bed, cluster, path)  # the engine serves now
            bed.write_config(
                path,
                vllm={
                    "env": {
                        "VRD_FAULT": "crash_during_load",
                        "VRD_LOAD_SECONDS": "2",
                        "VRD_PRINT_ENV": "HF_TOKEN",  # its log tail, in the reason, holds it
                    }
                },
                **common,
            )
            failed = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
            assert failed.is_failed(), failed
            yield Runs(
                bed, path, cluster, started, ok, failed, scan, workdir / "prefect-home", encrypted
            )
    finally:
        bed.down()


def _flow_run_ids(runs: Runs) -> list[Any]:
    return [runs.ok.state_details.flow_run_id, runs.failed.state_details.flow_run_id]


# --- the secrets were in play --------------------------------------------------------------------


def test_the_secrets_were_in_play(runs: Runs) -> None:
    # The key cannot be used without the passphrase, and the runs reached the nodes with it.
    with pytest.raises(paramiko.PasswordRequiredException):
        paramiko.Ed25519Key.from_private_key_file(str(runs.encrypted_key))
    paramiko.Ed25519Key.from_private_key_file(
        str(runs.encrypted_key), password=SECRETS["key_passphrase"]
    )
    assert runs.ok.result()["probe"]["healthy"]
    # The engine got the HF token, in its environment (acceptable) and not on its command line.
    assert f"HF_TOKEN={SECRETS['hf_token']}".encode() in runs.scan.engine_environ.split(b"\0")
    assert b"serve" in runs.scan.engine_cmdline and leaks(runs.scan.engine_cmdline) == []
    # The webhook secret is part of the configuration the flow loaded (and masks).
    with pytest.MonkeyPatch.context() as env:
        for key, value in ENV.items():
            env.setenv(key, value)
        config = load_config(runs.config_path, env_file=None)
    assert sorted(config.secret_values()) == sorted(SECRETS.values())


# --- where they must not appear --------------------------------------------------------------


def test_no_secret_on_any_command_line_while_serving(runs: Runs) -> None:
    scan = runs.scan
    assert scan.engine_pid in scan.cmdlines  # the search covered the engine itself
    assert len(scan.cmdlines) > 20  # sshd, dockerd, containerd, Ray, the stand-in, ...
    leaked = {pid: leaks(line) for pid, line in scan.cmdlines.items() if leaks(line)}
    assert leaked == {}, {pid: scan.cmdlines[pid][:200] for pid in leaked}
    # The same seen from the node, over SSH (with the passphrase-protected key).
    assert str(scan.engine_pid) in scan.ps_over_ssh and "serve" in scan.ps_over_ssh
    assert leaks(scan.ps_over_ssh) == []


def flow_run_logs(flow_run_id: Any) -> list[str]:
    with get_client(sync_client=True) as client:
        lines: list[str] = []
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
                offset=len(lines),
            )
            lines += [f"{log.name} {log.level} {log.message}" for log in page]
            if len(page) < 200:
                return lines


def test_no_secret_in_the_prefect_logs(runs: Runs) -> None:
    ok_id, failed_id = _flow_run_ids(runs)
    deadline = time.monotonic() + 30  # logs reach the server in batches
    while True:
        ok_logs, failed_logs = flow_run_logs(ok_id), flow_run_logs(failed_id)
        complete = any("started " + engine_container_name(runs) in x for x in ok_logs) and any(
            "failed at wait-ready" in x for x in failed_logs
        )
        if complete or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert complete, (ok_logs[-5:], failed_logs[-5:])
    assert any("step preflight" in x for x in ok_logs)
    assert any("HF_TOKEN=*****" in x for x in failed_logs)  # the reason's log tail, masked
    assert [x for x in ok_logs + failed_logs if leaks(x)] == []


def engine_container_name(runs: Runs) -> str:
    return engine_container(load_config(runs.config_path, env_file=None))


def _artifacts(flow_run_id: Any) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


def test_no_secret_in_any_artifact_nor_the_diagnostics(runs: Runs) -> None:
    ok_id, failed_id = _flow_run_ids(runs)
    ok, failed = _artifacts(ok_id), _artifacts(failed_id)
    keys = {a.key for a in ok + failed}
    assert f"{runs.cluster}-summary" in keys and f"{runs.cluster}-diagnostics" in keys
    diagnostics = next(a for a in failed if a.key == f"{runs.cluster}-diagnostics")
    text = str(diagnostics.data)
    assert "## node-1" in text and "nvidia-smi compute apps" in text
    assert "CUDA out of memory" in text  # the engine's own log is in it
    summary = next(a for a in failed if a.key == f"{runs.cluster}-summary")
    assert "HF_TOKEN=*****" in str(summary.data)  # the reason, with the log tail, masked
    for artifact in ok + failed:
        assert leaks(artifact.model_dump_json()) == [], artifact.key


def test_no_secret_in_flow_and_task_runs(runs: Runs) -> None:
    with get_client(sync_client=True) as client:
        for flow_run_id in _flow_run_ids(runs):
            flow_run = client.read_flow_run(flow_run_id)
            assert flow_run.parameters == {
                "config_path": str(runs.config_path),
                "mode": "redeploy",
                "keep_on_failure": False,
                "trigger": "manual",
                "override_pause": False,
            }
            assert leaks(flow_run.model_dump_json()) == []
            task_runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            assert any(t.name.startswith("preflight") for t in task_runs), task_runs
            for task_run in task_runs:
                assert leaks(task_run.model_dump_json()) == [], task_run.name


def test_no_secret_in_the_failure(runs: Runs) -> None:
    message = str(runs.failed.result(raise_on_failure=False))
    assert "wait-ready" in message and "exited with code 137" in message
    assert "HF_TOKEN=*****" in message  # the engine's log tail held the token: masked
    assert leaks(message) == []
    assert leaks(runs.failed.message or "") == []
    assert leaks(json.dumps(runs.ok.result())) == []  # the successful run's result, too


def _events_since(api: str, since: datetime) -> list[dict[str, Any]]:
    body = {"filter": {"occurred": {"since": since.isoformat()}}, "limit": 50}
    page = httpx.post(f"{api}/events/filter", json=body, timeout=30).json()
    events = list(page["events"])
    while page.get("next_page"):
        page = httpx.get(page["next_page"], timeout=30).json()
        events += page["events"]
    return events


def test_no_secret_in_any_prefect_event(runs: Runs, prefect_api: str) -> None:
    deadline = time.monotonic() + 30  # the server persists events every few seconds
    while True:
        events = _events_since(prefect_api, runs.started)
        failed = [
            e
            for e in events
            if e["event"] == "vllm.cluster.failed"
            and e["resource"]["prefect.resource.id"] == f"vllm-redeploy.cluster.{runs.cluster}"
        ]
        if failed or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert failed and "wait-ready" in failed[0]["payload"]["step"]
    assert "HF_TOKEN=*****" in json.dumps(failed[0]["payload"])
    assert len(events) > 20  # flow runs and task runs report their states as events
    assert [e["event"] for e in events if leaks(json.dumps(e))] == []


def _files(root: Path, since: float) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_mtime >= since]


def test_no_secret_in_what_prefect_stored(runs: Runs) -> None:
    # The server's database (SQLite and its WAL) and log, whatever the API does not show.
    stored = [p for p in runs.prefect_home.rglob("*") if p.is_file()]
    server_log = runs.prefect_home.parent / "prefect-server.log"
    db = [p for p in stored if p.name.startswith("prefect.db")]
    assert db, stored
    marker = runs.cluster.encode()  # this module's cluster name is in the database
    assert any(marker in p.read_bytes() for p in db)
    for path in [*stored, server_log]:
        assert leaks(path.read_bytes()) == [], path
    # Results this process persisted (task caches, flow results).
    storage = Path(str(PREFECT_LOCAL_STORAGE_PATH.value())).expanduser()
    if storage.exists():
        for path in _files(storage, runs.started.timestamp()):
            assert leaks(path.read_bytes()) == [], path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_REDEPLOY_")}
    return subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        env={**clean, **ENV, "COLUMNS": "200"},
        cwd=cwd,
        timeout=120,
    )


def test_no_secret_in_check_config_output(runs: Runs) -> None:
    for extra in ((), ("--json",)):
        proc = _cli("check-config", "--config", str(runs.config_path), *extra, cwd=runs.bed.root)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output
        assert leaks(output) == []
        if extra:
            data = json.loads(proc.stdout)
            masked = [data["secrets"]["hf_token"], data["secrets"]["webhook_secret"]]
            assert [*masked, data["ssh"]["key_passphrase"]] == ["*****"] * 3
        else:
            assert output.count("*****") >= 3


def test_no_secret_in_the_dry_run(runs: Runs) -> None:
    proc = _cli("run", "--config", str(runs.config_path), "--dry-run", cwd=runs.bed.root)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # It reached the nodes (the passphrase worked) and printed the engine's launch.
    assert "remove our earlier containers" in output and "vllm serve" in output
    assert leaks(output) == []
