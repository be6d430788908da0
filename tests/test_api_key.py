"""vLLM's API key: a secret (``[secrets] vllm_api_key``), given to the engine by environment
(VLLM_API_KEY, which vLLM reads when --api-key is not given), sent by every request of ours as
``Authorization: Bearer``, and shown nowhere.

The configuration refuses ``--api-key`` in extra_args (it would be on the engine's command line)
and VLLM_API_KEY in [vllm.env] (it would be in the file). On the bed, with the key set the way an
operator sets it (the environment), real Prefect, Ray and Docker and the vLLM stand-in, which
guards /v1 as vLLM 0.32.0 does (tests/test_vllm_differential.py compares it with the real
engine): the flow completes on both backends (wait-ready, transport, probe), `status` is healthy,
a request without the key gets vLLM's 401, a rotated key makes `ensure` redeploy, and the key is in
none of the flow's logs (read back from the Prefect server), its artifacts, the failure's
diagnostics, the dry run, check-config, the containers' Args/Cmd or the engine's command line.

The same runs show which ports stay open on every address (``ss -ltn`` by each container's
processes): the ones docs/operations.md names, and no other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
)
from typer.testing import CliRunner

from deployments.cli import app
from deployments.event_sender import EventSender
from deployments.watcher import ClusterWatcher
from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.test_config import MINIMAL
from tests.test_secrets import flow_run_logs
from tests.testbed import image
from tests.testbed.bed import SERVED_NAME, TestBed
from vllm_redeploy.config import ClusterConfig, ConfigError, load_config
from vllm_redeploy.launch import launch_fingerprint
from vllm_redeploy.launch.mp import mp_spec
from vllm_redeploy.launch.ray import engine_spec, ray_spec
from vllm_redeploy.nodes.containers import LABEL_CLUSTER
from vllm_redeploy.status import collect_status

REPO = Path(__file__).resolve().parents[1]
SECRET = "VLLM_REDEPLOY_SECRETS__VLLM_API_KEY"
KEYS = {run: f"sk-VrdApiKey-{run}-{uuid.uuid4().hex}" for run in ("first", "rotated")}


def leaks(text: str | bytes) -> list[str]:
    """Which of the keys appear in ``text``."""
    data = text.encode("utf-8", "replace") if isinstance(text, str) else text
    return [name for name, key in KEYS.items() if key.encode() in data]


def cluster(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(MINIMAL + extra)
    return path


# --- the configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        '["--api-key", "KEY"]',
        '["--api-key=KEY"]',
        '["--max-num-seqs", "16", "--api_key", "KEY"]',  # vLLM reads _ as -
        '["--api-k", "KEY"]',  # argparse takes an unambiguous prefix
        '["--api-key KEY"]',  # one item: refused for the key, not only for the shape
    ],
)
def test_api_key_in_extra_args_is_refused_with_the_way_to_the_secret(
    tmp_path: Path, args: str
) -> None:
    key = KEYS["first"]
    path = cluster(tmp_path, f"extra_args = {args.replace('KEY', key)}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env_file=None)
    (problem,) = info.value.problems
    assert problem.startswith("vllm.extra_args: --api")
    assert "command line" in problem and SECRET in problem and "VLLM_API_KEY" in problem
    assert "\n" not in problem and key not in str(info.value)
    result = CliRunner().invoke(app, ["check-config", "--config", str(path)])
    assert result.exit_code == 2 and SECRET in result.output and key not in result.output


def test_the_key_in_the_engine_environment_of_the_file_is_refused(tmp_path: Path) -> None:
    key = KEYS["first"]
    path = cluster(tmp_path, f'[vllm.env]\nVLLM_API_KEY = "{key}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env_file=None)
    assert "VLLM_API_KEY in [vllm.env]" in str(info.value) and SECRET in str(info.value)
    assert key not in str(info.value)


def test_other_flags_that_start_alike_are_vllms_own(tmp_path: Path) -> None:
    path = cluster(tmp_path, 'extra_args = ["--api-server-count", "2", "--api-", "x"]\n')
    assert load_config(path, env_file=None).vllm.extra_args[:2] == ["--api-server-count", "2"]


def keyed(path: Path, monkeypatch: pytest.MonkeyPatch, key: str) -> ClusterConfig:
    monkeypatch.setenv(SECRET, key)
    return load_config(path, env_file=None)


def test_only_the_api_server_gets_the_key_and_only_by_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cluster(tmp_path)
    plain = load_config(path, env_file=None)
    config = keyed(path, monkeypatch, KEYS["first"])
    assert config.secrets.vllm_api_key is not None and KEYS["first"] in config.secret_values()
    api_servers = [engine_spec(config), mp_spec(config.head, config)]
    others = [*(ray_spec(n, config) for n in config.nodes), mp_spec(config.workers[0], config)]
    for spec in api_servers:
        assert spec.env["VLLM_API_KEY"] == KEYS["first"]
        assert leaks(json.dumps([spec.entrypoint, spec.command])) == []
    for spec in others:
        assert "VLLM_API_KEY" not in spec.env and leaks(json.dumps(spec.env)) == []
    # An engine started without the key would answer keyed requests: ensure must replace it.
    # One started with another key answers 401 (the bed test below): the key is not digested.
    assert launch_fingerprint(config) != launch_fingerprint(plain)
    assert launch_fingerprint(config) == launch_fingerprint(keyed(path, monkeypatch, "sk-other"))


def test_check_config_masks_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET, KEYS["first"])
    path = cluster(tmp_path)
    text = CliRunner().invoke(app, ["check-config", "-c", str(path)])
    data = CliRunner().invoke(app, ["check-config", "-c", str(path), "--json"])
    assert text.exit_code == 0 and '# vllm_api_key = "*****"' in text.output
    assert json.loads(data.output)["secrets"]["vllm_api_key"] == "*****"
    assert leaks(text.output + data.output) == []


# --- on the bed ----------------------------------------------------------------------------------


@dataclass
class Seen:
    """What one run left to look at while its group served (or after it failed)."""

    state: Any
    key: str
    backend: str
    inspect: dict[str, dict[str, Any]] = field(default_factory=dict)  # container -> attrs
    engine_cmdline: bytes = b""
    listeners: list[Listener] = field(default_factory=list)


@dataclass(frozen=True)
class Listener:
    node: str
    container: str
    process: str  # its comm, as ss and ps show it (15 characters at most)
    address: str  # the local address; "*" for every address
    port: int


@dataclass
class Runs:
    bed: TestBed
    path: Path
    first: Seen  # ray, the first key
    rotated: Seen  # ray, ensure with a new key
    mp: Seen  # mp, the new key: it serves while the tests look


def _containers(bed: TestBed) -> dict[str, dict[str, Any]]:
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list():
                found[f"{node.name}/{c.name}"] = c.attrs
    return found


def _listeners(bed: TestBed) -> list[Listener]:
    """Every listening TCP socket of the group's processes (``ss -ltnp``: the bed's nodes
    share this machine's network namespace), by node, container and process."""
    owners: dict[int, tuple[str, str, str]] = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(filters={"label": f"{LABEL_CLUSTER}=bed"}):
                for pid, comm in c.top(ps_args="-eo pid,comm")["Processes"]:
                    owners[int(pid)] = (node.name, c.name.rsplit("-", 1)[-1], comm)
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in owners:
                every = address in ("*", "0.0.0.0", "[::]")
                found.add(Listener(*owners[pid], "*" if every else address, int(port)))
    return sorted(found, key=lambda x: (x.node, x.container, x.process, x.port))


def _run(bed: TestBed, path: Path, key: str, backend: str, mode: str, **env: str) -> Seen:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET, key)
        bed.write_config(path, vllm={"backend": backend, "env": {"VRD_LOAD_SECONDS": "1", **env}})
        state = redeploy_vllm_cluster(str(path), mode, return_state=True)
    seen = Seen(state, key, backend)
    if state.is_completed():
        seen.inspect = _containers(bed)
        pid = seen.inspect["node-1/vllm-redeploy-bed-engine"]["State"]["Pid"]
        seen.engine_cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        seen.listeners = _listeners(bed)
    return seen


@pytest.fixture(scope="module")
def runs(prefect_api: str) -> Iterator[Runs]:
    bed = make_bed(2, "h200", first_ip=205)
    path = bed.root / "keyed.toml"
    try:
        first = _run(bed, path, KEYS["first"], "ray", "redeploy")
        rotated = _run(bed, path, KEYS["rotated"], "ray", "ensure")
        mp = _run(bed, path, KEYS["rotated"], "mp", "redeploy")
        yield Runs(bed, path, first, rotated, mp)
    finally:
        bed.down()


@pytest.fixture(scope="module")
def failed(runs: Runs) -> Seen:
    """A run that fails (the engine crashes while loading) and leaves its diagnostics; its
    teardown removes the group, so only the last test asks for it."""
    return _run(
        runs.bed, runs.path, KEYS["rotated"], "mp", "redeploy", VRD_FAULT="crash_during_load"
    )


def models(bed: TestBed, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"http://{bed.nodes[0].ip}:30000/v1/models", headers=headers, timeout=10)


@pytest.mark.integration
def test_the_flow_serves_with_the_key_on_both_backends(runs: Runs) -> None:
    for seen in (runs.first, runs.rotated, runs.mp):
        assert seen.state.is_completed(), seen.state.result(raise_on_failure=False)
        result = seen.state.result()
        assert result["probe"]["healthy"], result["probe"]
        assert seen.backend in result["summary"] and "wait-ready" in result["summary"]
    # The first key was replaced: the old engine refused the new key, so ensure redeployed.
    notes = " ".join(runs.rotated.state.result()["summary"].splitlines())
    assert "redeploying:" in notes and "HTTP 401: the engine refused our API key" in notes


@pytest.mark.integration
def test_the_engine_wants_the_key_on_v1_and_status_is_healthy_with_it(
    runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed, key = runs.bed, KEYS["rotated"]  # the mp leader serves now
    refused = models(bed, None)
    assert (refused.status_code, refused.text) == (401, '{"error":"Unauthorized"}')
    assert models(bed, KEYS["first"]).status_code == 401
    assert models(bed, key).json()["data"][0]["id"] == SERVED_NAME
    assert httpx.get(f"http://{bed.nodes[0].ip}:30000/health", timeout=10).status_code == 200
    config = keyed(runs.path, monkeypatch, key)
    status = collect_status(config)
    assert status.healthy and status.backend == "mp", status.problems
    assert status.endpoint.generation is not None and status.endpoint.probe is not None
    assert status.endpoint.generation.verdict == "answered" and status.endpoint.probe.healthy
    shown = CliRunner().invoke(app, ["status", "-c", str(runs.path), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)[0]["healthy"] and leaks(shown.output) == []
    # Without the key, the same look names the 401 and what to do.
    monkeypatch.delenv(SECRET)
    problems = collect_status(load_config(runs.path, env_file=None), quick=True).problems
    assert any("HTTP 401: the engine wants an API key and none is set" in p for p in problems)


@pytest.mark.integration
def test_a_watcher_without_the_key_says_so_at_each_look_and_starts_no_recovery(
    runs: Runs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, prefect_api: str
) -> None:
    """The engine answers /v1 with 401 to a watcher that lacks the key (a secret added after
    install-controller ran): a redeploy would not fix that, so no look counts as bad."""
    monkeypatch.delenv(SECRET, raising=False)
    path = runs.bed.write_config(
        runs.bed.root / "watched.toml",
        vllm={"backend": "mp", "env": {"VRD_LOAD_SECONDS": "1"}},
        watch={"failures": 1},
    )
    sender = EventSender(prefect_api)
    watcher = ClusterWatcher(load_config(path, env_file=None), sender)
    with caplog.at_level(logging.WARNING, logger="vllm_redeploy.watch"):
        for _ in range(3):
            watcher.look_once()
    sender.close()
    said = [r.getMessage() for r in caplog.records if "refuses the watcher's requests" in r.message]
    assert len(said) == 3, caplog.text
    assert "(HTTP 401: the engine wants an API key and none is set" in said[0]
    assert "no recovery is started" in said[0] and "install-controller" in said[0]
    assert (watcher.state.bad, watcher.state.reported, sender.sent) == (0, False, 0)


@pytest.mark.integration
def test_the_probe_command_sends_the_key(runs: Runs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET, KEYS["rotated"])  # the mp leader serves with it now
    shown = CliRunner().invoke(app, ["probe", "-c", str(runs.path), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["healthy"], shown.output
    bare = ["probe", "--url", f"http://{runs.bed.nodes[0].ip}:30000", "--model", SERVED_NAME]
    assert CliRunner().invoke(app, bare).exit_code == 0
    monkeypatch.delenv(SECRET)
    refused = CliRunner().invoke(app, [*bare, "--json"])
    assert refused.exit_code == 1 and "401" in json.loads(refused.output)["detail"], refused.output


@pytest.mark.integration
def test_the_key_is_in_the_api_servers_environment_only_never_in_its_arguments(
    runs: Runs,
) -> None:
    for seen in (runs.first, runs.rotated, runs.mp):
        assert seen.inspect, seen.backend
        for name, attrs in seen.inspect.items():
            shown = json.dumps([attrs["Path"], attrs["Args"], attrs["Config"]["Cmd"]])
            shown += json.dumps([attrs["Config"]["Entrypoint"], attrs["Config"]["Labels"]])
            assert "serve" in shown or "ray" in shown, name  # the program is in what we read
            assert leaks(shown) == [], name
            env = attrs["Config"]["Env"]
            # As HF_TOKEN: in the environment of the container that serves the API, which
            # `docker inspect` shows to whoever may use the node's Docker (docs/operations.md).
            wanted = [f"VLLM_API_KEY={seen.key}"] if name.endswith("-engine") else []
            assert [e for e in env if e.startswith("VLLM_API_KEY=")] == wanted, name
        assert b"serve" in seen.engine_cmdline and leaks(seen.engine_cmdline) == []


@pytest.mark.integration
def test_the_dry_run_says_the_key_is_given_and_masks_it(
    runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET, KEYS["rotated"])
    result = CliRunner().invoke(app, ["run", "-c", str(runs.path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "vllm serve" in result.output and "remove our earlier containers" in result.output
    assert "VLLM_API_KEY=*****" in result.output and "Bearer *****" in result.output
    assert leaks(result.output) == []


# What stays open on every address, by backend (docs/operations.md, "Ports and firewall"): the
# process, and the port where it is fixed. Everything else of the group is on the fabric IP.
EVERY_ADDRESS = {
    # The GCS, the raylets (node and object manager), every Ray worker's and the engine's own
    # core worker (a Ray driver: python).
    "ray": ("gcs_server", "raylet", "ray::RayWorkerW", "python"),
    "mp": ("python",),  # the leader's torch TCPStore on the master port
}
LOOPBACK = "127.0.0.1"  # a node's own: not reachable from another host


@pytest.mark.integration
def test_only_the_ports_the_docs_name_listen_on_every_address(runs: Runs) -> None:
    config = load_config(runs.path, env_file=None)  # the bed's addresses and ports
    docs = (REPO / "docs" / "operations.md").read_text()
    section = docs[docs.index("## Ports and firewall") :]
    for seen in (runs.first, runs.mp):
        every = [x for x in seen.listeners if x.address == "*"]
        pinned = [x for x in seen.listeners if x.address != "*"]
        assert every and pinned, seen.listeners
        assert {x.process for x in every} <= set(EVERY_ADDRESS[seen.backend]), every
        # The API on the address [vllm] host names (the bed's: the head's IP), the rest of what
        # can be bound on the node's own fabric IP.
        ips = {n.name: n.ip for n in config.nodes}
        assert {(x.address, x.port) for x in pinned if x.port == 30000} == {(ips["node-1"], 30000)}
        assert all(x.address in (ips[x.node], LOOPBACK) for x in pinned), pinned
        if seen.backend == "ray":
            gcs = {(x.node, x.port) for x in every if x.process == "gcs_server"}
            assert gcs == {("node-1", config.ray.port)}
            assert any(x.process.startswith("ray::RuntimeEnv") for x in pinned)  # node IP
        else:
            assert {(x.node, x.container, x.port) for x in every} == {
                ("node-1", "engine", config.vllm.master_port)
            }
    for words in ("Ray's GCS", "raylet", "master_port", "NCCL", "nft", "VLLM_API_KEY"):
        assert words in section, words


def _artifacts(flow_run_id: Any) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


@pytest.mark.integration
def test_the_key_is_in_no_log_artifact_result_nor_the_diagnostics(runs: Runs, failed: Seen) -> None:
    every = (runs.first, runs.rotated, runs.mp, failed)
    ids = [seen.state.state_details.flow_run_id for seen in every]
    deadline = time.monotonic() + 30  # logs reach the server in batches
    while True:
        logs = [flow_run_logs(flow_run_id) for flow_run_id in ids]
        complete = all(any("step probe" in x for x in run) for run in logs[:3]) and any(
            "failed at wait-ready" in x for x in logs[3]
        )
        if complete or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert complete, [run[-3:] for run in logs]
    assert any("started vllm-redeploy-bed-engine" in x for x in logs[2])  # the launch is logged
    assert [x for run in logs for x in run if leaks(x)] == []
    artifacts = [a for flow_run_id in ids for a in _artifacts(flow_run_id)]
    diagnostics = [a for a in artifacts if a.key == "bed-diagnostics"]
    assert {"bed-summary", "bed-load"} <= {a.key for a in artifacts} and diagnostics
    assert "## node-1" in str(diagnostics[0].data) and "engine" in str(diagnostics[0].data)
    assert [a.key for a in artifacts if leaks(a.model_dump_json())] == []
    assert failed.state.is_failed()
    assert leaks(str(failed.state.result(raise_on_failure=False))) == []
    assert leaks(json.dumps([s.state.result() for s in every[:3]])) == []


@pytest.mark.integration
def test_an_engine_that_wants_another_key_stops_the_wait_at_the_first_401(
    runs: Runs, failed: Seen
) -> None:
    """An image that carries VLLM_API_KEY itself (a key nobody gave us): the engine serves,
    answers every /v1 request of ours with 401, and would for as long as it runs; the wait
    stops at once, naming it, instead of waiting model_load_s for a model it cannot see."""
    bed = runs.bed
    made = next(m for m in image.BED_IMAGES if m.tag == bed.vllm_image)
    tag = "vrd-bed/keyed-by-the-image:1"
    changes = [*made.changes(), f"ENV VLLM_API_KEY={KEYS['first']}-of-the-image"]
    bed.nodes[0].engine.import_rootfs(image.rootfs(), tag, changes)
    bundle = bed.nodes[0].engine.save(tag)
    for node in bed.nodes[1:]:
        node.engine.load(bundle)
    path = bed.root / "keyed-by-the-image.toml"
    bed.write_config(path, deadlines={"model_load_s": 60}, vllm={"image": tag, "backend": "mp"})
    state = redeploy_vllm_cluster(str(path), return_state=True)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and message.startswith("wait-ready: "), message
    assert "HTTP 401: the engine wants an API key and none is set" in message, message
    assert "the run stops instead of waiting 60 s" in message, message
