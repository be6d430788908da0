"""Step "cluster-lock": one run per cluster at a time, whichever deployment, process or worker
started it, through a restart of the Prefect server as through a dead holder.

Two things on the Prefect server make the lock:
- a global concurrency limit of 1 named after the cluster (``vllm-redeploy-cluster-<name>``):
  taking its slot is how one run, and only one, gets to write the record;
- the record, a Variable naming the holder (flow run, lease, last beat): the holder beats it every
  ``BEAT_S`` while it lives, and it is what every other run reads before it goes ahead.

A Prefect server keeps its leases in memory unless told otherwise: restarted, it forgets the
holder's lease while its database still counts the slot as taken. The holder then takes a slot
back (its record still names it, so no one else goes ahead meanwhile), and a run that finds the
slot taken frees it itself when the record shows the holder is gone: its flow run finished,
crashed or deleted, released, or its beat not renewed for ``[lock] lease_s`` (on the server's
clock, or watched that long). A slot counted without a lease is freed by an anonymous decrement,
which frees whatever slot is counted: one waiting run claims it in the record first, and nobody
makes it once the record names someone else. A holder whose
record names another run (it lost the cluster while it could not reach the server for longer
than ``lease_s``) stops before its next step that changes the nodes: ``Hold.confirm``.

To free a cluster by hand: ``prefect gcl update vllm-redeploy-cluster-<name> --active-slots 0``
and ``prefect variable unset vllm_redeploy__<name>__lock_holder``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from uuid import UUID

import httpx
from prefect import get_client, runtime
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.client.schemas.objects import TERMINAL_STATES, ConcurrencyLeaseHolder, StateType
from prefect.exceptions import MissingContextError, ObjectAlreadyExists, ObjectNotFound
from prefect.logging import get_logger
from prefect.variables import Variable

from tasks.context import StepFailed, log
from tasks.records import on_own_schedule
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import lock_name, variable_name
from vllm_redeploy.safe_text import one_line

STEP = "cluster-lock"
POLL_S = 2.0  # a waiting run asks this often: the next run starts within seconds of the last
BEAT_S = 10.0  # the holder renews its lease and its record this often
SAY_EVERY_S = 30.0  # while waiting, who holds the cluster is logged this often
CLOCK_SLACK_S = 30.0  # a record this much older than lease_s (server clock) is stale by age alone
# ...once the server has answered this long: a live holder beats again within BEAT_S, its
# failed beats being retried every POLL_S: its calls fail fast (tasks/records.py,
# on_own_schedule), so nothing waits in the client's backoff for minutes after an outage.
AFTER_OUTAGE_S = BEAT_S + 2 * POLL_S
SETTLE_S = 0.5  # two runs' writes to the record made at once have both landed after this
CLAIM_S = 10.0  # a waiting run's claim to free a gone holder's slot, unfinished this long, lapses
# A run that has just taken the slot has written its record within this: until then, a slot
# counted under a gone holder's record may be that new holder's, its record on its way.
RECORDED_WITHIN_S = BEAT_S


@dataclass(frozen=True)
class Record:
    """Who holds the cluster (the Variable ``vllm_redeploy__<cluster>__lock_holder``)."""

    flow_run_id: str
    flow_run_name: str = ""
    deployment: str = ""
    since: str = ""
    beat: str = ""  # the holder's last renewal, ISO 8601 UTC
    lease_id: str = ""
    released: bool = False
    freed_by: str = ""  # the waiting run that freed the slot of this gone holder
    # Not stored: how long ago the record was written, measured when it was read (age_s).
    written_s_ago: float | None = field(default=None, compare=False)

    @classmethod
    def read(cls, cluster: str) -> Record | None:
        with get_client(sync_client=True) as client:
            try:
                response = client.request(
                    "GET",
                    "/variables/name/{name}",
                    path_params={"name": variable_name(cluster, "lock_holder")},
                )
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code == 404:
                    return None
                raise
        found = response.json()
        value = found.get("value")
        if not isinstance(value, dict) or not value.get("flow_run_id"):
            return None
        fields = {k for k in cls.__dataclass_fields__ if k != "written_s_ago"}
        record = cls(**{k: v for k, v in value.items() if k in fields})
        return replace(record, written_s_ago=_server_age_s(response, found.get("updated")))

    def write(self, cluster: str) -> None:
        stored = {k: v for k, v in asdict(self).items() if k != "written_s_ago"}
        Variable.set(variable_name(cluster, "lock_holder"), stored, overwrite=True)

    def described(self) -> str:
        """`` (flow run NAME of DEPLOYMENT, since T)``."""
        of = f" of {self.deployment}" if self.deployment else ""
        since = f", since {self.since}" if self.since else ""
        return f" (flow run {self.flow_run_name or self.flow_run_id}{of}{since})"

    def age_s(self) -> float:
        """Seconds since the holder last wrote the record, on the Prefect server's clock alone;
        0 when the server did not say (then only a reader's own watch finds it stale)."""
        return max(self.written_s_ago or 0.0, 0.0)


def _server_age_s(response: httpx.Response, updated: str | None) -> float | None:
    """The Variable's age by the server's clock: its answer's Date against the time it stored
    with the Variable. Never the reader's clock against the holder's: a laptop ~140 s behind
    would make its own live run look gone at once to every other run and to the watcher."""
    try:
        now = parsedate_to_datetime(response.headers["date"])
        return (now - datetime.fromisoformat(str(updated))).total_seconds()
    except (KeyError, TypeError, ValueError):
        return None


def ensure_cluster_lock(cluster: str) -> str:
    """Create the cluster's limit (1 slot, active) if missing, or set it right; its name."""
    name = lock_name(cluster)
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run made it just now
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1, active=True)
                )
            return name
        if limit.limit != 1 or not limit.active:
            client.update_global_concurrency_limit(
                name, GlobalConcurrencyLimitUpdate(limit=1, active=True)
            )
    return name


@on_own_schedule
def holder(config: ClusterConfig) -> Record | None:
    """The run holding the cluster now, judged as a waiting run judges it at first sight (not
    released, its flow run not finished, not stale by the server's clock); None if none."""
    record = Record.read(config.name)
    if record is None or record.released or record.age_s() >= _stale_after(config.lock.lease_s):
        return None
    with get_client(sync_client=True) as client:
        return None if _finished(client, record, config.lock.lease_s) else record


class Hold:
    """This run's hold on the cluster: renewed on a thread until ``release``."""

    def __init__(
        self, config: ClusterConfig, record: Record, holder: ConcurrencyLeaseHolder, waited: float
    ) -> None:
        self.config, self.record, self.holder, self.waited = config, record, holder, waited
        self.lost: Record | None = None  # the run that took the cluster from this one
        self.renewed = time.monotonic()  # this run's last beat that reached the record
        self._log = log()  # the flow run's logger, for the renewal thread too
        self._stop = threading.Event()
        # In this run's context: its Prefect settings (the API it talks to) and its logger.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._renew,), name=f"lock-{config.name}", daemon=True
        )
        self._thread.start()

    @on_own_schedule
    def confirm(self) -> None:
        """Before a step that changes the nodes: the record still names this run, read from the
        server (waited for up to ``lease_s`` while it does not answer)."""
        deadline = time.monotonic() + self.config.lock.lease_s
        while self.lost is None:
            try:
                record = Record.read(self.config.name)
            except Exception as exc:  # a server restart: nobody else can take it meanwhile
                if time.monotonic() > deadline:
                    raise StepFailed(
                        STEP,
                        f"could not confirm that this run still holds {self.config.name}: the "
                        f"Prefect server has not answered for {self.config.lock.lease_s:g} s "
                        f"({one_line(exc)}); stopped before changing the nodes",
                    ) from None
                time.sleep(POLL_S)
                continue
            if record is not None and record.flow_run_id != self.record.flow_run_id:
                self.lost = record
            break
        if self.lost is not None:
            raise StepFailed(STEP, self._loss())

    def _loss(self) -> str:
        """Why this run no longer holds the cluster, and who does."""
        assert self.lost is not None
        unrenewed_s = time.monotonic() - self.renewed
        lease_s = self.config.lock.lease_s
        why = (
            f"while this one could not renew its hold for [lock] lease_s = {lease_s:g} s "
            f"(its last renewal {unrenewed_s:.0f} s ago: paused, or the Prefect server away)"
            if unrenewed_s >= lease_s
            else f"from this one, which renewed its hold {unrenewed_s:.0f} s ago (its record "
            "was replaced: the cluster freed by hand, or two runs' writes crossed)"
        )
        return (
            f"another run took {self.config.name} {why}{self.lost.described()}; this run "
            "stopped before changing the nodes, and leaves them to that run"
        )

    @on_own_schedule
    def release(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.lost is not None:
            return
        with get_client(sync_client=True) as client, contextlib.suppress(Exception):
            _release_lease(client, self.record.lease_id)
        try:
            current = Record.read(self.config.name)
            if current is not None and current.flow_run_id != self.record.flow_run_id:
                log().warning("another run holds the cluster now%s", current.described())
                return  # its record stays
            replace(self.record, released=True, beat=_now()).write(self.config.name)
        except Exception as exc:  # the next run sees this flow run finished instead
            log().warning("could not mark the cluster released: %s", one_line(exc))

    @on_own_schedule
    def _renew(self) -> None:
        complained = False
        with get_client(sync_client=True) as client:
            while not self._stop.wait(POLL_S if complained else BEAT_S):
                try:
                    self._beat(client)
                    complained = False
                except Exception as exc:  # the server away: keep the hold, try again soon
                    if not complained:
                        self._log.warning("could not renew the hold on the cluster: %s",
                                          one_line(exc))  # fmt: skip
                    complained = True
                if self.lost is not None:
                    self._log.warning("another run took the cluster%s", self.lost.described())
                    return

    def _beat(self, client: SyncPrefectClient) -> None:
        current = Record.read(self.config.name)
        if current is not None and current.flow_run_id != self.record.flow_run_id:
            self.lost = current
            return
        lease_id = self.record.lease_id
        if not _renew_lease(client, lease_id, self.config.lock.lease_s):
            lease_id = _take_back(client, self.config, self.holder)
            if lease_id:
                self._log.warning(
                    "the Prefect server had lost this run's lease on the cluster (restarted "
                    "without its lease storage); took the slot back"
                )
        self.record = replace(self.record, beat=_now(), lease_id=lease_id)
        self.record.write(self.config.name)
        self.read_back()

    def read_back(self) -> None:
        """After this run wrote the record: a run that wrote it meanwhile keeps the cluster."""
        again = Record.read(self.config.name)
        if again is not None and again.flow_run_id != self.record.flow_run_id:
            self.lost = again
        else:
            self.renewed = time.monotonic()


@contextmanager
def cluster_lock(config: ClusterConfig) -> Iterator[Hold]:
    """Hold the cluster for the block."""
    name = ensure_cluster_lock(config.name)
    me = str(runtime.flow_run.id or uuid.uuid4())
    lease_holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(me))
    started = time.monotonic()
    lease_id = _wait_for_slot(config, name, me, lease_holder)
    waited = time.monotonic() - started
    record = Record(
        me,
        runtime.flow_run.name or "",
        runtime.deployment.name or "",
        since=_now(),
        beat=_now(),
        lease_id=lease_id,
    )
    try:
        record.write(config.name)
    except Exception as exc:
        with get_client(sync_client=True) as client, contextlib.suppress(Exception):
            _release_lease(client, lease_id)
        raise StepFailed(
            STEP, f"took {name} but could not record this run as its holder: {one_line(exc)}"
        ) from None
    if waited >= 1:
        log().info("holding the cluster after waiting %.0f s for another run", waited)
    hold = Hold(config, record, lease_holder, waited)
    with contextlib.suppress(Exception):  # the server away: the first beat reads it back
        hold.read_back()
    try:
        yield hold
    finally:
        hold.release()


@on_own_schedule
def _wait_for_slot(
    config: ClusterConfig, name: str, me: str, lease_holder: ConcurrencyLeaseHolder
) -> str:
    """The lease of the cluster's slot, once its holder is gone; StepFailed after wait_s."""
    started = time.monotonic()
    deadline = started + config.lock.wait_s
    seen: dict[tuple[str, str, str] | None, float] = {}  # each record's state, when first seen
    said = started
    answering = started  # since when the server has answered without a break
    record: Record | None = None
    with get_client(sync_client=True) as client:
        while True:
            lease_id = ""
            try:
                lease_id = _try_acquire(client, name, config.lock.lease_s, lease_holder)
                record = Record.read(config.name)
                key = (record.flow_run_id, record.beat, record.freed_by) if record else None
                first_seen = seen.setdefault(key, time.monotonic())
                answered_s = time.monotonic() - answering
                gone = _gone(client, record, me, config.lock.lease_s, first_seen, answered_s)
                if lease_id and gone:
                    return lease_id
                if lease_id:  # a live holder whose lease the server forgot takes its slot back
                    _release_lease(client, lease_id)
                elif (
                    gone
                    and record is not None
                    and _free(client, config.name, record, me, time.monotonic() - first_seen)
                ):
                    continue  # freed: take it at once
            except Exception as exc:  # the server away: what was seen before says nothing now
                with contextlib.suppress(Exception):
                    _release_lease(client, lease_id)
                seen.clear()
                answering = time.monotonic() + POLL_S
                log().warning("could not ask the Prefect server for %s: %s", name, one_line(exc))
            now = time.monotonic()
            if now >= deadline:
                raise StepFailed(STEP, _waited_too_long(config, now - started, record))
            if now - said >= SAY_EVERY_S:
                said = now
                held_by = record.described() if record else ""
                log().info("waiting for %s: another run holds it%s (%.0f s so far)", name,
                           held_by, now - started)  # fmt: skip
            time.sleep(POLL_S)


def _gone(
    client: SyncPrefectClient,
    record: Record | None,
    me: str,
    lease_s: float,
    first_seen: float,
    answered_s: float = float("inf"),
) -> bool:
    """May this run take the cluster from ``record``'s holder? A beat that is old by the clock
    says so only once the server has answered long enough for a live holder to beat again
    (``answered_s``): right after an outage every holder's beat is as old as the outage."""
    if record is None or record.released or record.flow_run_id == me:
        return True
    if time.monotonic() - first_seen >= lease_s:
        return True  # watched for lease_s without a beat: its controller is gone
    if record.age_s() >= _stale_after(lease_s) and answered_s >= AFTER_OUTAGE_S:
        return True
    return _finished(client, record, lease_s)


def _stale_after(lease_s: float) -> float:
    return lease_s + CLOCK_SLACK_S


_said_alive: set[tuple[str, str]] = set()  # (flow run, run that waits): said once each


def _finished(client: SyncPrefectClient, record: Record, lease_s: float) -> bool:
    """Has the holder's flow run ended? Crashed with a fresh beat has not: Prefect marks a run
    Crashed when its heartbeats stop reaching the server (the server away, the controller
    stalled), while its process may still hold the cluster; only its own beat says it is gone.
    Prefect lets such a run leave Crashed for Completed when it ends."""
    try:
        run = client.read_flow_run(UUID(record.flow_run_id))
    except (ObjectNotFound, ValueError):
        return True
    if run.state_type == StateType.CRASHED and record.age_s() < lease_s:
        said = (record.flow_run_id, str(runtime.flow_run.id))
        if said not in _said_alive:
            _said_alive.add(said)
            _logger().info(
                "the cluster's holder%s is marked Crashed in Prefect, but it beat the cluster's "
                "lock %.0f s ago (a holder is gone after [lock] lease_s = %g s without a beat): "
                "its controller still runs it, so this run waits",
                record.described(), max(record.age_s(), 0.0), lease_s,
            )  # fmt: skip
        return False
    return run.state_type in TERMINAL_STATES


def _try_acquire(
    client: SyncPrefectClient, name: str, lease_s: float, holder: ConcurrencyLeaseHolder
) -> str:
    """The lease of the cluster's one slot, or ``""`` while it is taken."""
    try:
        response = client.increment_concurrency_slots_with_lease(
            names=[name], slots=1, mode="concurrency", lease_duration=lease_s, holder=holder
        )
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 423:
            return ""
        raise
    return str(response.json()["lease_id"])


def _renew_lease(client: SyncPrefectClient, lease_id: str, lease_s: float) -> bool:
    """False when the server no longer knows the lease (it forgot it, or it ran out)."""
    if not lease_id:
        return False
    try:
        client.renew_concurrency_lease(lease_id=UUID(lease_id), lease_duration=lease_s)
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code in (404, 410):
            return False
        raise
    return True


def _take_back(
    client: SyncPrefectClient, config: ClusterConfig, holder: ConcurrencyLeaseHolder
) -> str:
    """A new lease for the holder whose lease the server lost; its old slot, still counted, is
    freed first. ``""`` if another run's attempt has the slot this moment (it backs off)."""
    name = lock_name(config.name)
    lease_id = _try_acquire(client, name, config.lock.lease_s, holder)
    if lease_id:
        return lease_id
    current = Record.read(config.name)  # the slot counted may be a new holder's by now
    if current is not None and current.flow_run_id != str(holder.id):
        return ""
    client.release_concurrency_slots(names=[name], slots=1, occupancy_seconds=1.0)
    return _try_acquire(client, name, config.lock.lease_s, holder)


def _free(
    client: SyncPrefectClient, cluster: str, record: Record, me: str, seen_for_s: float
) -> bool:
    """Free the slot a gone holder left taken: its lease if the server still has it; else the
    slot the server counts without a lease (a restart forgot it), which only an anonymous
    decrement frees. That one frees whatever slot is counted, a new holder's too, so it is
    made only once the record has named the gone holder for ``RECORDED_WITHIN_S`` (the
    winner of a hand-off takes the slot a moment before its record says so), and by one
    waiting run: each claims it in the record, and after a moment only the claim that stayed
    goes on (a claim left ``CLAIM_S`` by a run that died may be claimed again). True once the
    slot is free."""
    name = lock_name(cluster)
    _release_lease(client, record.lease_id)  # a no-op once the server has dropped it
    if not client.read_global_concurrency_limit_by_name(name).active_slots:
        return True
    if seen_for_s < RECORDED_WITHIN_S:
        return False  # the slot may be a new holder's, its record on its way
    if record.freed_by and seen_for_s < CLAIM_S:
        return False  # another waiting run is freeing it
    if not _same(Record.read(cluster), record):
        return False  # another run took the cluster, or claimed the slot, since
    log().info("the cluster's last holder is gone%s: freeing the slot the server still counts "
               "for it", record.described())  # fmt: skip
    replace(record, released=True, freed_by=me).write(cluster)
    time.sleep(SETTLE_S)
    claimed = Record.read(cluster)
    if claimed is None or claimed.freed_by != me:
        return False
    if client.read_global_concurrency_limit_by_name(name).active_slots:
        client.release_concurrency_slots(names=[name], slots=1, occupancy_seconds=1.0)
    return True


def _same(now: Record | None, seen: Record) -> bool:
    def key(r: Record) -> tuple[str, str, bool, str]:
        return (r.flow_run_id, r.beat, r.released, r.freed_by)

    return now is not None and key(now) == key(seen)


def _release_lease(client: SyncPrefectClient, lease_id: str) -> None:
    if lease_id:
        client.release_concurrency_slots_with_lease(lease_id=UUID(lease_id))


def _waited_too_long(config: ClusterConfig, waited: float, record: Record | None) -> str:
    held_by = record.described() if record else ""
    return (
        f"another run of {config.name} has held the cluster for {waited / 60:.0f} min{held_by}; "
        f"this run waited [lock] wait_s = {config.lock.wait_s:g} s. A holder that is gone "
        f"(finished, or no beat for [lock] lease_s) is freed by the next run; free it by hand "
        f"with `prefect gcl update {lock_name(config.name)} --active-slots 0`"
    )


def _logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The run's logger; the watcher's asks outside any run."""
    try:
        return log()
    except MissingContextError:
        return get_logger("vllm_redeploy.lock")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
