"""Step "cluster-lock": one run per cluster at a time, whichever deployment, process or worker
started it.

The lock is a global concurrency limit of 1 on the Prefect server, named after the cluster
(``vllm-redeploy-cluster-<name>``), held for the whole run through a lease. A run that arrives
while another holds it waits (queued, never dropped) up to ``[lock] wait_s``, saying who holds
it, then fails. The lease is renewed every 3/4 of ``[lock] lease_s`` while the run lives; a run
that dies holding it (its controller killed, its machine lost) stops renewing, and the server
frees the cluster ``lease_s`` after the last renewal (its repossessor looks every 15 s). To free
it at once: ``prefect gcl update vllm-redeploy-cluster-<name> --active-slots 0``.

The holder is also written to a Prefect Variable, only to name it in the waiting messages: the
lease, not the Variable, is the lock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from prefect import get_client, runtime
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.variables import Variable

from tasks.context import StepFailed, log
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import lock_name, variable_name

STEP = "cluster-lock"
SAY_EVERY_S = 30.0  # while waiting, who holds the cluster is logged this often


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


@contextmanager
def cluster_lock(config: ClusterConfig) -> Iterator[float]:
    """Hold the cluster for the block; yields the seconds spent waiting for it."""
    name = ensure_cluster_lock(config.name)
    run_id = runtime.flow_run.id
    holder = ConcurrencyLeaseHolder(type="flow_run", id=run_id) if run_id else None
    started = time.monotonic()
    deadline = started + config.lock.wait_s
    while True:
        acquired = False
        try:
            with concurrency(
                name,
                occupy=1,
                timeout_seconds=max(1.0, min(SAY_EVERY_S, deadline - time.monotonic())),
                lease_duration=config.lock.lease_s,
                strict=True,
                holder=holder,
                # A renewal that fails once (a server restart) must not kill a 20-minute load.
                raise_on_lease_renewal_failure=False,
            ):
                acquired = True
                waited = time.monotonic() - started
                _record_holder(config.name, waited)
                yield waited
            return
        except TimeoutError:
            if acquired:  # raised inside the block: not ours to interpret
                raise
        waited = time.monotonic() - started
        held_by = _holder(config.name)
        if time.monotonic() >= deadline:
            raise StepFailed(
                STEP,
                f"another run of {config.name} has held the cluster for {waited / 60:.0f} min"
                f"{held_by}; this run waited [lock] wait_s = {config.lock.wait_s:g} s. If that "
                "run is gone, the cluster is freed [lock] lease_s after its last renewal; free it "
                f"now with `prefect gcl update {name} --active-slots 0`",
            ) from None
        log().info("waiting for %s: another run holds it%s (%.0f s so far)", name, held_by, waited)


def _record_holder(cluster: str, waited: float) -> None:
    value: dict[str, Any] = {
        "flow_run_id": str(runtime.flow_run.id or ""),
        "flow_run_name": runtime.flow_run.name or "",
        "deployment": runtime.deployment.name or "",
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        Variable.set(variable_name(cluster, "lock_holder"), value, overwrite=True)
    except Exception as exc:  # informational only: the lease is the lock
        log().warning("could not record the cluster's holder: %s", exc)
    if waited >= 1:
        log().info("holding the cluster after waiting %.0f s for another run", waited)


def _holder(cluster: str) -> str:
    """`` (flow run NAME of DEPLOYMENT, since T)`` from the last holder's record, or ``""``."""
    try:
        value = Variable.get(variable_name(cluster, "lock_holder"))
    except Exception:  # informational only
        return ""
    if not isinstance(value, dict) or not value.get("flow_run_name"):
        return ""
    of = f" of {value['deployment']}" if value.get("deployment") else ""
    return f" (flow run {value['flow_run_name']}{of}, since {value.get('since', '?')})"
