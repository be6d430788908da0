"""A reboot reported to the webhook, to the after-reboot flow run being Running, on a real server.

`vllm-redeploy serve` serves the deployments; the webhook runs in this process and keeps events
in its spool, which the watcher's forwarder (here on a thread) posts to the same server, as the
services do. Each call carries a new boot id, so each is a new boot; the debounce window is
1 s and the bench waits it out between rounds, so every round starts exactly one run. Two ways:
one node reporting with ``reboot_delay_s = 0`` (the trigger path alone), and every node reporting
with the default ``reboot_delay_s`` (the run starts once the last one has, not after the delay).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from bench.flowruns import stamp
from bench.measure import write_config
from bench.prefect_server import QUIET
from deployments.spool import Spool
from deployments.webhook import SECRET_ENV, running_webhook
from tests.test_deployments import call, deployments_by_name, runs_of
from tests.test_webhook_spool import forwarding
from tests.testbed.bed import TestBed
from tests.testbed.procs import spawn, stop
from vllm_redeploy.config import ClusterConfig, WebhookConfig, load_config

BIN = Path(sys.executable).parent
DEBOUNCE_S = 1.0
DEFAULT_DELAY_S = float(WebhookConfig.model_fields["reboot_delay_s"].default)
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
T = TypeVar("T")


@contextlib.contextmanager
def _secret(value: str) -> Iterator[None]:
    saved = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = saved


def _wait_for(what: str, check: Callable[[], T | None], timeout: float, log: Path) -> T:
    deadline = time.monotonic() + timeout
    while (found := check()) is None:
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise TimeoutError(f"{what} not seen after {timeout:g} s\n{tail}")
        time.sleep(0.25)  # the server's timestamps are read, not this loop's
    return found


def _deployment_id(api_url: str, name: str) -> str | None:
    found = deployments_by_name(api_url).get(name)
    return found["id"] if found else None


def _new_run(api_url: str, deployment_id: str, known: set[str]) -> dict[str, Any] | None:
    fresh = [r for r in runs_of(api_url, deployment_id) if r["id"] not in known]
    return fresh[0] if fresh and fresh[0]["start_time"] else None


def _finished(api_url: str, deployment_id: str, run_id: str) -> dict[str, Any] | None:
    runs = {r["id"]: r for r in runs_of(api_url, deployment_id)}
    return runs[run_id] if runs[run_id]["state_type"] in FINAL else None


@dataclass
class RebootLags:
    one_node_s: list[float] = field(default_factory=list)  # reboot_delay_s = 0, one node
    all_nodes_s: list[float] = field(default_factory=list)  # the default delay, every node
    delay_s: float = DEFAULT_DELAY_S


def webhook_to_running(api_url: str, bed: TestBed, env: dict[str, str], runs: int) -> RebootLags:
    """Seconds from the (last) signed call of each round to its flow run's start (Running).
    The cluster must be healthy with the stand-in ``env`` it was deployed with: the runs are
    `ensure` no-ops."""
    secret = uuid.uuid4().hex
    webhook = {"reboot_debounce_s": DEBOUNCE_S, "reboot_delay_s": 0}
    path = write_config(bed, "served", env, webhook=webhook)
    log = bed.root / "serve.log"
    env = {**QUIET, "PREFECT_API_URL": api_url}
    argv = [str(BIN / "vllm-redeploy"), "serve", "--config", str(path)]
    proc = spawn(argv, log, env)
    lags = RebootLags()
    try:
        with _secret(secret):
            cluster = load_config(path, env_file=None)
        name = f"{cluster.name}-after-reboot"
        deployment = _wait_for(name, lambda: _deployment_id(api_url, name), 90, log)
        waiting = cluster.model_copy(
            update={"webhook": cluster.webhook.model_copy(update={"reboot_delay_s": lags.delay_s})}
        )
        rounds = [(cluster, [bed.nodes[0].name], lags.one_node_s)]
        rounds.append((waiting, [n.name for n in bed.nodes], lags.all_nodes_s))
        for config, nodes, found in rounds:
            with _spooled(config, api_url) as spool, running_webhook(config, spool) as url:
                for _ in range(runs):
                    found.append(_one_round(api_url, deployment, url, nodes, secret, log))
    finally:
        stop(proc, grace=10)
    return lags


@contextlib.contextmanager
def _spooled(config: ClusterConfig, api_url: str) -> Iterator[Spool]:
    """The webhook's spool, and the watcher's forwarder posting it to ``api_url``."""
    with tempfile.TemporaryDirectory(prefix="vrd-bench-spool-") as tmp:
        base = Path(tmp)
        with forwarding(config, base, api_url):
            yield Spool(base, [config.name])


def _one_round(
    api_url: str, deployment: str, url: str, nodes: list[str], secret: str, log: Path
) -> float:
    """Every node in ``nodes`` reports a new boot, one after the other; seconds from the last
    call to the run's start."""
    known = {r["id"] for r in runs_of(api_url, deployment)}
    for node in nodes:
        sent = time.time()
        call(url, node, str(uuid.uuid4()), secret=secret).raise_for_status()
    new = partial(_new_run, api_url, deployment, known)
    run = _wait_for("the triggered run", new, 120, log)
    end = partial(_finished, api_url, deployment, run["id"])
    done = _wait_for("its end", end, 180, log)
    if done["state_type"] != "COMPLETED":
        raise RuntimeError(f"the triggered ensure run ended {done['state_type']}")
    time.sleep(DEBOUNCE_S + 1)
    return (stamp(run["start_time"]) or 0.0) - sent
