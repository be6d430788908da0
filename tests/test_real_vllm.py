"""The product against the real vLLM (0.32.0, its CPU build; tests/testbed/real_vllm.py) on two
bed nodes with the mp backend: the README scenario, the leader killed while `serve` and `watch`
keep the cluster up, a busy engine and a frozen follower under the watcher's generations, a
follower killed, and a follower firewalled from the leader by a real iptables rule. Each fault
shows what the real engine does (where it is harder than a kind stand-in) and that the product
still reaches a clear state.

Each test that needs a served cluster starts with ``ensure`` (a no-op when it is served), so
each stands on its own; in file order they share starts (three starts and a failing one). What
each fault took is kept in tests/output/real-vllm-*.md for the team's notes."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.test_recovery import Controller, finished, wait_for
from tests.testbed import image, real_vllm, users
from tests.testbed.bed import SERVED_NAME, TestBed
from tests.testbed.procs import freeze_container
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.nodes.containers import LABEL_CLUSTER
from vllm_redeploy.status import collect_status

pytestmark = [pytest.mark.integration, pytest.mark.real_vllm, pytest.mark.timeout(600)]
LEADER, FOLLOWER = "engine", "follower"  # the roles' container names' ends (mp: the leader serves)
# Its own name: the recovery deployment (CLUSTER-recover) lives on the session's Prefect server.
CLUSTER = f"real{uuid.uuid4().hex[:6]}"
WATCH = {"interval_s": 1, "failures": 2, "max_recoveries": 3, "window_s": 900, "backoff_s": 1}


@pytest.fixture(scope="module")
def real_bed(prefect_api: str) -> Iterator[TestBed]:
    if (why := real_vllm.missing()) is not None:
        pytest.fail(why, pytrace=False)
    # All of a first day on real Sparks at once: the login nvidia, OpenSSH's limits, the model in
    # the Hugging Face cache by repo id, an NGC-shaped image, and node-2's engine upgraded to 29.
    bed = make_bed(2, "h200", first_ip=201, vllm_image=real_vllm.NGC_IMAGE, docker29=("node-2",))
    try:
        yield bed
    finally:
        bed.down()


@pytest.fixture
def path(real_bed: TestBed) -> Path:
    return real_bed.write_config(real_bed.root / "real.toml", name=CLUSTER)


def container(bed: TestBed, node: int, role: str) -> Any:
    with contextlib.closing(bed.nodes[node].engine.client()) as client:
        return client.containers.get(f"vllm-redeploy-{CLUSTER}-{role}")


def url(bed: TestBed, route: str) -> str:
    return f"http://{bed.nodes[0].ip}:30000{route}"


def status_code(bed: TestBed, route: str) -> int | None:
    try:
        return httpx.get(url(bed, route), timeout=5).status_code
    except httpx.HTTPError:
        return None


def chat(bed: TestBed, max_tokens: int = 16, **extra: Any) -> httpx.Response:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return httpx.post(url(bed, "/v1/chat/completions"), json=body, timeout=180)


def served(path: Path) -> dict[str, Any]:
    """Bring the cluster to served (``ensure``) and return the run's result."""
    state = redeploy_vllm_cluster(str(path), "ensure", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    return state.result()


def test_the_readme_scenario_on_the_real_engine(real_bed: TestBed, path: Path) -> None:
    started = time.monotonic()
    state = redeploy_vllm_cluster(str(path), return_state=True)
    took = time.monotonic() - started
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    keep_for_notes("real-vllm-run", result["summary"])
    assert result["probe"]["healthy"], result["probe"]
    # What the real engine said of itself, read by the product from /version.
    assert f"vLLM {real_vllm.VERSION}" in result["summary"]
    # Its help was asked: no fast loader imports in its image, so it loads with its own default
    # and says how long that took ("Loading weights took N seconds").
    assert (
        "- loader vLLM's default loader (auto: the image's Python does not import instanttensor; "
        "the image's Python does not import fastsafetensors)" in result["summary"]
    )
    assert re.search(r"- weights loaded in \d+\.\d+ s \(vLLM's own time\)", result["summary"])
    assert "--load-format" not in container(real_bed, 0, LEADER).attrs["Config"]["Cmd"]
    # The answer our user sees from a thinking model, from the real reasoning parser.
    answer = chat(real_bed).json()["choices"][0]
    assert answer["message"]["content"] is None and answer["finish_reason"] == "length", answer
    assert answer["message"]["reasoning"].strip(), answer

    status = collect_status(load_config(path, env_file=None))
    assert status.healthy and status.backend == "mp", status.problems
    # Each part of the first day was in play: NVIDIA's entrypoint ran ahead of vLLM, which was
    # given the repo id, offline, with the cache's model-- tree; node-2 answered as Docker 29.
    leader = container(real_bed, 0, LEADER).attrs
    assert leader["Config"]["Entrypoint"][0] == image.NGC_ENTRYPOINT
    assert leader["Config"]["Cmd"][:3] == ["vllm", "serve", real_vllm.REPO_ID]
    assert "HF_HUB_OFFLINE=1" in leader["Config"]["Env"]
    assert [m["Source"] for m in leader["Mounts"] if "models--" in m["Source"]] == [
        str(real_bed.hub / "models--vrd--tiny-qwen3")
    ]
    config = load_config(path, env_file=None)
    with NodeAccess(config.nodes[1], config) as node2:
        assert node2.docker.version().startswith("29.")  # through the gate
    assert {n.ssh_user for n in config.nodes} == {users.LOGIN}
    ids = {n: container(real_bed, n, role).id for n, role in ((0, LEADER), (1, FOLLOWER))}
    assert served(path)["action"] == "already healthy: nothing changed"
    assert ids == {n: container(real_bed, n, role).id for n, role in ((0, LEADER), (1, FOLLOWER))}
    print(f"real engine: run to served and probed in {took:.1f} s")


def test_a_killed_leader_leaves_its_follower_up_until_a_recovery_replaces_both(
    real_bed: TestBed, path: Path, prefect_api: str
) -> None:
    """The leader killed while `serve` and `watch` keep the cluster up. The real follower does
    not notice (vllm#32136): the watcher sees it still running without its leader, and the
    recovery run replaces both ranks."""
    served(path)
    ctl = Controller(real_bed, real_bed.root / "watched.toml", CLUSTER, prefect_api, {})
    real_bed.write_config(ctl.path, name=CLUSTER, watch=WATCH, webhook={"reboot_delay_s": 0})
    ctl.start()
    try:
        before = len(finished(ctl.runs("recover")))
        follower = container(real_bed, 1, FOLLOWER).id
        container(real_bed, 0, LEADER).kill()
        killed = time.monotonic()
        event = wait_for(lambda: ctl.events("vllm.cluster.unhealthy"), 60, "the unhealthy event")
        noticed = time.monotonic() - killed
        problems = event[0]["payload"]["problems"]
        assert "the vLLM leader (rank 0) on node-1 is not running" in problems, problems
        assert (
            "the vLLM follower on node-2 still runs without the vLLM leader (rank 0), and cannot "
            "join a new one; the next run (or ensure) replaces the whole group" in problems
        ), problems
        runs = wait_for(lambda: finished(ctl.runs("recover"))[before:], 300, "the recovery run")
        recovered = time.monotonic() - killed
        assert runs[0]["state_type"] == "COMPLETED", runs[0]
        assert chat(real_bed).status_code == 200
        assert container(real_bed, 1, FOLLOWER).id != follower  # both ranks, started together
    finally:
        ctl.stop()
    keep_for_notes(
        "real-vllm-recovered",
        f"leader killed -> unhealthy {noticed:.1f} s -> served again {recovered:.1f} s\n",
    )


def unhealthy_since(ctl: Controller, since: datetime) -> list[dict[str, Any]]:
    return [
        e
        for e in ctl.events("vllm.cluster.unhealthy")
        if datetime.fromisoformat(e["occurred"].replace("Z", "+00:00")) > since
    ]


def test_a_busy_engine_is_left_alone_and_a_frozen_follower_is_recovered(
    real_bed: TestBed, path: Path, prefect_api: str
) -> None:
    """The watcher sends a 1-token generation at every look. While long generations fill the
    engine (one sequence at a time), it gets no answer but the engine's tokens advance: busy,
    no event. Then every process of the follower is stopped (a node that hangs): the real
    leader keeps /health at 200 and its models listed, and waits for the lost rank; the
    generation gets no answer and no token moves: unhealthy, and the recovery replaces both."""
    served(path)
    ctl = Controller(real_bed, real_bed.root / "generating.toml", CLUSTER, prefect_api, {})
    watch = {**WATCH, "generate_every": 1, "generate_timeout_s": 2}
    real_bed.write_config(ctl.path, name=CLUSTER, watch=watch, webhook={"reboot_delay_s": 0})
    ctl.start()
    log = real_bed.root / "watch.log"
    started = datetime.now(UTC)  # the module's earlier tests told of this cluster too
    try:
        mark = len(log.read_text().splitlines())
        busy_until = time.monotonic() + 20
        while time.monotonic() < busy_until:  # back to back, as a loaded server
            long = chat(real_bed, max_tokens=900, ignore_eos=True)
            assert long.status_code == 200, long.text
        time.sleep(3)  # a look or two after the load
        looks = log.read_text().splitlines()[mark:]
        busy = [line for line in looks if f"{CLUSTER}: busy: no 1-token answer" in line]
        assert busy, looks
        assert not unhealthy_since(ctl, started), looks
        keep_for_notes("real-vllm-busy-looks", "\n".join(looks) + "\n")

        before = len(finished(ctl.runs("recover")))
        follower = container(real_bed, 1, FOLLOWER)
        freeze_container(follower)
        frozen, frozen_at = time.monotonic(), datetime.now(UTC)
        assert status_code(real_bed, "/health") == 200
        assert SERVED_NAME in httpx.get(url(real_bed, "/v1/models"), timeout=5).text
        event = wait_for(lambda: unhealthy_since(ctl, frozen_at), 60, "the unhealthy event")
        noticed = time.monotonic() - frozen
        problems = event[0]["payload"]["problems"]
        assert any(p.startswith("the engine hangs: a 1-token generation got no answer within 2 s")
                   for p in problems), problems  # fmt: skip
        runs = wait_for(lambda: finished(ctl.runs("recover"))[before:], 300, "the recovery run")
        recovered = time.monotonic() - frozen
        assert runs[0]["state_type"] == "COMPLETED", runs[0]
        assert chat(real_bed).status_code == 200
        assert container(real_bed, 1, FOLLOWER).id != follower.id
    finally:
        ctl.stop()
    keep_for_notes(
        "real-vllm-frozen",
        f"follower frozen -> unhealthy {noticed:.1f} s -> served again {recovered:.1f} s\n",
    )


def test_a_killed_follower_leaves_the_leader_answering_until_a_request_fails(
    real_bed: TestBed, path: Path
) -> None:
    served(path)
    container(real_bed, 1, FOLLOWER).kill()
    time.sleep(5)
    # The real leader notices nothing until a step needs the lost rank.
    assert status_code(real_bed, "/health") == 200
    assert SERVED_NAME in httpx.get(url(real_bed, "/v1/models"), timeout=5).text
    status = collect_status(load_config(path, env_file=None))
    assert "the vLLM follower on node-2 is not running" in status.problems, status.problems
    generation = status.endpoint.generation
    assert generation is not None and generation.verdict == "failed", generation
    assert "HTTP 500" in generation.detail and generation.detail in status.problems
    # After that failed request the leader exits, and with code 0: not a clean stop all the same.
    leader = container(real_bed, 0, LEADER)
    started = time.monotonic()
    wait_for(lambda: leader.reload() or leader.status == "exited", 60, "the leader's exit")
    exited = time.monotonic() - started
    assert leader.attrs["State"]["ExitCode"] == 0, leader.attrs["State"]
    keep_for_notes(
        "real-vllm-follower-killed",
        f"follower killed; /health 200 until a generation's HTTP 500; leader exited with code "
        f"0 {exited:.1f} s after it\n",
    )


def _firewall(rule: str, cgroup: str, port: int) -> list[str]:
    """A real packet filter on the bed's host: drop what the follower's container sends to the
    master port. On one machine every node's traffic leaves from 127.0.0.1, so the rule tells
    the follower by its container's cgroup, as a host firewall tells it by its address."""
    return ["iptables", rule, "OUTPUT", "-p", "tcp", "--dport", str(port),
            "-m", "cgroup", "--path", cgroup, "-j", "DROP"]  # fmt: skip


def test_a_firewalled_follower_is_named_with_both_ranks_logs(real_bed: TestBed, path: Path) -> None:
    firewalled = real_bed.write_config(
        real_bed.root / "firewalled.toml", name=CLUSTER, deadlines={"rendezvous_s": 15}
    )
    port = load_config(firewalled, env_file=None).vllm.master_port
    rules: list[list[str]] = []

    node = real_bed.nodes[1]
    name = {"name": f"vllm-redeploy-{CLUSTER}-follower"}
    with contextlib.closing(node.engine.client()) as client:  # an earlier group's, removed first
        earlier = {c.id for c in client.containers.list(all=True, filters=name)}

    def block_the_follower() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not rules:
            with contextlib.closing(node.engine.client()) as client:
                found = [c for c in client.containers.list(filters=name) if c.id not in earlier]
            if found:
                rule = _firewall("-I", f"docker/{found[0].id}", port)
                subprocess.run(rule, check=True, capture_output=True)
                rules.append(rule)
            time.sleep(0.1)

    blocker = threading.Thread(target=block_the_follower, daemon=True)
    blocker.start()
    try:
        state = redeploy_vllm_cluster(str(firewalled), return_state=True)
    finally:
        blocker.join(timeout=5)
        for rule in rules:
            subprocess.run(["iptables", "-D", *rule[2:]], check=False, capture_output=True)
    assert rules, "the follower's container never appeared"
    assert state.is_failed(), state
    message = str(state.result(raise_on_failure=False))
    keep_for_notes("real-vllm-firewalled", message)
    assert message.startswith(
        f"wait-ready: node-2 never joined the rendezvous at {real_bed.nodes[0].ip}:{port}"
    ), message
    assert "the follower on node-2 holds no connection to it" in message
    # The real engine's own words, from both ranks: each waits in torch.distributed's rendezvous.
    theirs, ours = message.split("Last log lines of the leader on node-1:")
    assert (
        f"world_size=2 rank=1 local_rank=0 distributed_init_method=tcp://{real_bed.nodes[0].ip}"
        in theirs
    )
    assert "world_size=2 rank=0 local_rank=0 distributed_init_method=tcp://" in ours
    # Nothing of the failed group is left running.
    for node in real_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            assert client.containers.list(filters={"label": f"{LABEL_CLUSTER}={CLUSTER}"}) == []
