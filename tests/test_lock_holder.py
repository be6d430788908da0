"""The cluster lock knows its holder (issue 34, item 1), against the session's real Prefect
server, with nothing but the lock itself: a slot the server still counts for a finished run is
freed by the next run at once; a live holder is waited for even when its slot is free; a holder
whose lease the server dropped takes a slot back; a run that lost the cluster to another stops
before its next step that changes the nodes."""

from __future__ import annotations

import contextvars
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from prefect import flow, get_client
from prefect.client.schemas.objects import ConcurrencyLeaseHolder, Flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from tasks.context import StepFailed
from tasks.standing.lock import (
    BEAT_S,
    RECORDED_WITHIN_S,
    Record,
    _free,
    _try_acquire,
    cluster_lock,
    ensure_cluster_lock,
    holder,
)
from tasks.standing.runs import runs_at_hand
from tests.testbed.flaky_api import flaky_api
from vllm_redeploy.config import load_config
from vllm_redeploy.names import lock_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def cluster_file(tmp_path: Path, name: str, wait_s: int = 60) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\n'
        '[[nodes]]\nname = "a"\naddress = "127.0.0.1"\n'
        '[vllm]\nimage = "vllm/vllm-openai:v0.19.0"\nmodel = "/models/m"\n'
        f"[lock]\nwait_s = {wait_s}\nlease_s = 60\n"
    )
    return path


def active(url: str, cluster: str) -> int:
    response = httpx.get(f"{url}/v2/concurrency_limits/{lock_name(cluster)}", timeout=10)
    return int(response.json()["active_slots"])


def slot_without_lease(cluster: str) -> None:
    """The slot as a restarted server leaves it: counted in its database, no lease to free it."""
    ensure_cluster_lock(cluster)
    with get_client(sync_client=True) as client:
        client.increment_concurrency_slots(names=[lock_name(cluster)], slots=1, mode="concurrency")


def a_flow_run(state: str = "RUNNING") -> str:
    """Another run of the cluster, in ``state``, as the server keeps it."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(Flow(name="some-other-run"))
        body = {"flow_id": str(flow_id), "state": {"type": state}}
        return str(client.request("POST", "/flow_runs/", json=body).json()["id"])


@flow
def take_the_cluster(path: str, then: str = "") -> float:
    config = load_config(path, env_file=None)
    with cluster_lock(config) as hold:
        if then == "stolen":
            Record(a_flow_run(), "thief", beat=_now()).write(config.name)
            hold.confirm()
        if then == "lease-dropped":
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(
                    lease_id=uuid.UUID(hold.record.lease_id)
                )
            assert active_now(config.name) == 0
            deadline = time.monotonic() + BEAT_S * 3
            while active_now(config.name) == 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            hold.confirm()
            return float(active_now(config.name))
        return hold.waited


def active_now(cluster: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(lock_name(cluster)).active_slots


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def test_a_slot_left_counted_for_a_finished_run_is_freed_by_the_next(
    prefect_api: str, tmp_path: Path
) -> None:
    cluster = f"left{uuid.uuid4().hex[:6]}"
    slot_without_lease(cluster)
    finished = a_flow_run("COMPLETED")
    Record(finished, "finished-run", since=_now(), beat=_now()).write(cluster)
    waited = take_the_cluster(str(cluster_file(tmp_path, cluster)))
    # Freed once the record named the finished run for RECORDED_WITHIN_S, then taken at once.
    assert waited < RECORDED_WITHIN_S + 5, waited
    assert active(prefect_api, cluster) == 0  # released at the end, not left counted again
    record = Record.read(cluster)
    assert record is not None and record.released


def test_a_live_holder_is_waited_for_even_with_its_slot_free(
    prefect_api: str, tmp_path: Path
) -> None:
    cluster = f"live{uuid.uuid4().hex[:6]}"
    ensure_cluster_lock(cluster)  # the slot free: the server forgot the lease and freed it
    Record(a_flow_run(), "loading-run", since=_now(), beat=_now()).write(cluster)
    config = load_config(cluster_file(tmp_path, cluster, wait_s=6), env_file=None)
    assert holder(config) is not None  # the watcher counts the cluster as busy
    with pytest.raises(StepFailed, match=r"held the cluster .*flow run loading-run"):
        take_the_cluster(str(cluster_file(tmp_path, cluster, wait_s=6)))
    assert active(prefect_api, cluster) == 0  # it let go of the slot it got meanwhile


def test_a_holder_whose_clock_is_behind_is_not_taken_for_gone(
    prefect_api: str, tmp_path: Path
) -> None:
    """A manual run from a laptop whose clock is 200 s behind writes beats that read 200 s old
    on the controller's clock. Its record is as fresh as the server says it is: the watcher
    counts the cluster busy, and a waiting run waits past the time a stale beat would be judged
    by the clock (AFTER_OUTAGE_S, then lease_s + 30 s) until its own wait_s."""
    cluster = f"behind{uuid.uuid4().hex[:6]}"
    ensure_cluster_lock(cluster)
    behind = (datetime.now(UTC) - timedelta(seconds=200)).isoformat(timespec="seconds")
    Record(a_flow_run(), "laptop-run", since=behind, beat=behind).write(cluster)
    config = load_config(cluster_file(tmp_path, cluster, wait_s=16), env_file=None)
    seen = holder(config)
    assert seen is not None and seen.flow_run_name == "laptop-run"
    assert seen.age_s() < 10, seen  # the server's clock: written just now
    with pytest.raises(StepFailed, match=r"held the cluster .*flow run laptop-run"):
        take_the_cluster(str(cluster_file(tmp_path, cluster, wait_s=16)))


def test_a_holder_whose_lease_was_dropped_takes_a_slot_back(
    prefect_api: str, tmp_path: Path
) -> None:
    cluster = f"dropped{uuid.uuid4().hex[:6]}"
    slots = take_the_cluster(str(cluster_file(tmp_path, cluster)), "lease-dropped")
    assert slots == 1


def test_a_run_that_lost_the_cluster_stops_before_changing_the_nodes(
    prefect_api: str, tmp_path: Path
) -> None:
    cluster = f"stolen{uuid.uuid4().hex[:6]}"
    """Its record replaced while it beat as it should (by hand, here): the message says that,
    never that it could not renew its hold."""
    replaced = r"from this one, which renewed its hold \d+ s ago \(its record was replaced"
    with pytest.raises(
        StepFailed, match=rf"another run took \S+ {replaced}.*\(flow run thief\)"
    ) as raised:
        take_the_cluster(str(cluster_file(tmp_path, cluster)), "stolen")
    assert raised.value.step == "cluster-lock"
    record = Record.read(cluster)
    assert record is not None and record.flow_run_name == "thief"  # not overwritten on release


def run_logs(flow_run_id: str) -> list[str]:
    with get_client(sync_client=True) as client:
        body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}
        return [x["message"] for x in client.request("POST", "/logs/filter", json=body).json()]


def test_a_holder_marked_crashed_that_still_beats_is_waited_for(
    prefect_api: str, tmp_path: Path
) -> None:
    """Prefect marks a run Crashed when its heartbeats stop reaching the server (an outage, a
    stalled controller); its process may still hold the cluster and beat the lock's record:
    waited for, and listed by `pause` as holding the cluster."""
    cluster = f"crashed{uuid.uuid4().hex[:6]}"
    ensure_cluster_lock(cluster)
    Record(a_flow_run("CRASHED"), "stalled-run", since=_now(), beat=_now()).write(cluster)
    path = str(cluster_file(tmp_path, cluster, wait_s=6))
    assert holder(load_config(path, env_file=None)) is not None  # the watcher: busy
    (listed,) = runs_at_hand(load_config(path, env_file=None))  # what `pause` prints
    assert listed.holds and listed.crashed, listed
    assert "holds the cluster (marked Crashed in Prefect, yet it still beats" in listed.line()
    state = take_the_cluster(path, return_state=True)
    assert state.is_failed()
    with pytest.raises(StepFailed, match=r"held the cluster .*flow run stalled-run"):
        state.result()
    said = "is marked Crashed in Prefect, but it beat the cluster's lock"
    deadline = time.monotonic() + 15  # the run's logs reach the server in batches
    while not any(said in m for m in run_logs(str(state.state_details.flow_run_id))):
        assert time.monotonic() < deadline, "the waiting run did not say why it waits"
        time.sleep(0.5)


def test_a_crashed_holder_whose_beat_is_older_than_the_lease_is_gone(
    prefect_api: str, tmp_path: Path
) -> None:
    """A record is as old as the server says (its clock, not the writer's): the dead holder's
    last beat is left to age past the lease (60 s) on the server."""
    cluster = f"dead{uuid.uuid4().hex[:6]}"
    slot_without_lease(cluster)
    Record(a_flow_run("CRASHED"), "dead-run", since=_now(), beat=_now()).write(cluster)
    deadline = time.monotonic() + 90
    while (record := Record.read(cluster)) is not None and record.age_s() < 61:
        assert time.monotonic() < deadline, record
        time.sleep(1)
    waited = take_the_cluster(str(cluster_file(tmp_path, cluster)))
    assert waited < RECORDED_WITHIN_S + 5, waited


@flow
def free_as(cluster: str, seen: Record, me: str) -> None:
    """``_free`` as a waiting run calls it once it has seen ``seen`` long enough."""
    with get_client(sync_client=True) as client:
        _free(client, cluster, seen, me, RECORDED_WITHIN_S)


def test_a_stale_sight_of_a_gone_holder_never_frees_the_next_holders_slot(
    prefect_api: str, tmp_path: Path
) -> None:
    """Two runs wait on a gone holder whose slot the server counts without a lease (a restart
    forgot it). Both saw it gone; the first frees the slot (the one anonymous decrement) and
    takes the cluster; the second, acting on what it saw a moment before, must not free the
    first one's slot: the record no longer names the gone holder."""
    cluster = f"twice{uuid.uuid4().hex[:6]}"
    slot_without_lease(cluster)
    Record(a_flow_run("COMPLETED"), "gone-run", since=_now(), beat=_now()).write(cluster)
    seen = Record.read(cluster)
    assert seen is not None
    free_as(cluster, seen, "first-waiter")
    assert active_now(cluster) == 0
    with get_client(sync_client=True) as client:
        holder_ = ConcurrencyLeaseHolder(type="flow_run", id=uuid.uuid4())
        lease = _try_acquire(client, lock_name(cluster), 60, holder_)
    assert lease
    Record(a_flow_run(), "first-waiter", since=_now(), beat=_now(), lease_id=lease).write(cluster)
    free_as(cluster, seen, "second-waiter")
    assert active_now(cluster) == 1  # the first waiter's slot, still counted
    record = Record.read(cluster)
    assert record is not None and record.flow_run_name == "first-waiter"


HELD: list[tuple[float, float]] = []  # each hold's (entered, leaving), on this process's clock


@flow
def hold_then_hand_over(path: str, hold_s: float) -> None:
    """Take the cluster, hold it ``hold_s`` (confirmed at both ends), release it."""
    config = load_config(path, env_file=None)
    with cluster_lock(config) as hold:
        entered = time.monotonic()
        hold.confirm()
        time.sleep(hold_s)
        hold.confirm()
        HELD.append((entered, time.monotonic()))


def slow_record_writes(method: str, path: str) -> float:
    return 0.3 if method in ("POST", "PATCH") and path.startswith("/variables") else 0.0


@pytest.mark.timeout(400)
def test_twenty_hand_offs_between_two_waiting_runs_with_slow_record_writes(
    prefect_api: str, tmp_path: Path
) -> None:
    """Three runs take turns, so that two wait at every hand-off, through a proxy that holds
    back every write of the record 300 ms: the winner of a hand-off has taken the slot before
    its record says so. No run fails with a loss, and the server (asked directly, every 0.1 s)
    never counts no slot while a run is inside its hold."""
    cluster = f"turns{uuid.uuid4().hex[:6]}"
    path = str(cluster_file(tmp_path, cluster, wait_s=300))
    ensure_cluster_lock(cluster)
    HELD.clear()
    failures: list[str] = []
    samples: list[tuple[float, int]] = []
    turns = iter(range(20))
    turn = threading.Lock()
    done = threading.Event()

    def contend() -> None:
        while True:
            with turn:
                if next(turns, None) is None:
                    return
            state = hold_then_hand_over(path, 1.0, return_state=True)
            if not state.is_completed():
                failures.append(str(state.message))

    def watch() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), active(prefect_api, cluster)))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with flaky_api(prefect_api, delay=slow_record_writes) as proxy:
        with temporary_settings({PREFECT_API_URL: proxy.url}):
            runs = [
                threading.Thread(target=contextvars.copy_context().run, args=(contend,))
                for _ in range(3)
            ]
        for thread in runs:
            thread.start()
        for thread in runs:
            thread.join(360)
    done.set()
    watcher.join(10)
    assert failures == [], failures
    assert len(HELD) == 20, HELD
    freed_under = [t for t, n in samples if n == 0 and any(a <= t <= b for a, b in HELD)]
    assert freed_under == [], (freed_under, HELD)
