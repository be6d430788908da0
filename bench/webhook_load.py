"""The reboot webhook under load: latency, status codes and events at a steady request rate.

    .venv/bin/python -m bench.webhook_load [--rate 200] [--duration 10] [--boots 8]

The service is the real one: ``serve_webhook`` (uvicorn with its access log, as
``vllm-redeploy webhook`` runs it) in its own process on 127.0.0.1, keeping each event in its
spool (a temporary directory; written whole and fsynced before the 202), which nothing forwards
during the run and which is read afterwards. One asyncio process drives it open-loop (request i
leaves at start + i/rate whether or not earlier ones have answered; latency counts from that
scheduled moment) through httpx with keep-alive, mixing:

- valid calls: a few node/boot pairs, each signed afresh and sent again and again, as a
  notifier retries (every one must get 202);
- replayed calls: genuinely signed calls captured earlier, sent verbatim after their timestamp
  left the replay window (401);
- forged calls: signed with another key, a body changed after signing, or random hex (401).

The service emits one event per accepted call; each event's id derives from cluster, node and boot,
so Prefect (which drops an event id it already has) stores one per boot. Writes
bench/results/webhook_load.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.report import write_results
from deployments.event_sender import EVENT_REBOOTED, reboot_event_id
from deployments.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, serve_webhook, sign
from vllm_redeploy.config import ClusterConfig

KINDS = ("valid", "replayed", "forged")
MIX = {"valid": 0.6, "replayed": 0.2, "forged": 0.2}
NODES = ("node-1", "node-2")


def _serve(config: ClusterConfig, port: int, log_path: str) -> None:
    """The service process: its stdout and stderr (uvicorn's and the app's log) go to a file."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    serve_webhook(config, "127.0.0.1", port)


@dataclass
class LoadResult:
    rate: float
    duration_s: float
    sent: Counter[str] = field(default_factory=Counter)  # per kind
    statuses: Counter[int] = field(default_factory=Counter)
    by_kind: dict[str, Counter[int | str]] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    transport_errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # first scheduled send to last answer
    send_span_s: float = 0.0  # first scheduled send to the last call actually sent
    max_send_lag_ms: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    cluster_events: list[dict[str, Any]] = field(default_factory=list)
    boots: set[tuple[str, str]] = field(default_factory=set)  # valid (node, boot) pairs sent
    cluster: str = ""
    healthy_after: bool = False
    refusals_logged: int = 0
    load_before: float = 0.0  # 1-minute load average of the machine
    load_after: float = 0.0
    client_cpu_s: float = 0.0  # this process: the load generator
    service_cpu_s: float = 0.0  # the service process, start-up included

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    @property
    def achieved_rate(self) -> float:
        """Answers per second over the whole run (first send to last answer)."""
        return self.total / self.wall_s if self.wall_s else 0.0

    @property
    def send_rate(self) -> float:
        """Calls per second the generator managed to send (below ``rate`` when it lags)."""
        return (self.total - 1) / self.send_span_s if self.send_span_s else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    @property
    def expected_event_ids(self) -> set[str]:
        return {reboot_event_id(self.cluster, node, boot) for node, boot in self.boots}

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def _config(name: str, secret: str, spool: Path) -> ClusterConfig:
    return ClusterConfig(  # type: ignore[call-arg]
        _env_file=None,
        name=name,
        nodes=[{"name": n, "address": f"127.0.0.{201 + i}"} for i, n in enumerate(NODES)],
        vllm={"image": "vrd-bench/none:1", "model": "/models/none"},
        webhook={"spool_dir": str(spool)},
        secrets={"webhook_secret": secret},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body(node: str, boot: str, uptime: float) -> bytes:
    return json.dumps({"node": node, "boot_id": boot, "uptime_s": uptime}).encode()


class _Calls:
    """Builds each kind of call at the moment it leaves (fresh timestamps where they must be)."""

    def __init__(self, secret: str, boots: list[tuple[str, str]], window_s: float, seed: int):
        self.secret = secret
        self.boots = boots
        self.window_s = window_s
        self.random = random.Random(seed)  # noqa: S311 - a load mix, not a secret
        self.next_boot = 0

    def make(self, kind: str) -> tuple[bytes, dict[str, str], tuple[str, str] | None]:
        rnd = self.random
        node, boot = self.boots[self.next_boot % len(self.boots)]
        uptime = round(rnd.uniform(5, 600), 2)
        now = int(time.time())
        if kind == "valid":
            self.next_boot += 1
            body = _body(node, boot, uptime)
            return body, self._headers(self.secret, now, body), (node, boot)
        if kind == "replayed":  # captured long ago, sent verbatim: signature good, time stale
            then = now - int(self.window_s) - rnd.randint(5, 86400)
            body = _body(node, str(uuid.UUID(int=rnd.getrandbits(128), version=4)), uptime)
            return body, self._headers(self.secret, then, body), None
        body = _body(node, str(uuid.UUID(int=rnd.getrandbits(128), version=4)), uptime)
        how = rnd.choice(["other key", "changed body", "random hex"])
        if how == "other key":
            return body, self._headers(secrets.token_hex(32), now, body), None
        if how == "changed body":
            headers = self._headers(self.secret, now, body)
            return _body(node, boot, uptime + 1), headers, None
        headers = self._headers(self.secret, now, body)
        headers[SIGNATURE_HEADER] = "sha256=" + secrets.token_hex(32)
        return body, headers, None

    @staticmethod
    def _headers(secret: str, ts: int, body: bytes) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: str(ts),
            SIGNATURE_HEADER: sign(secret, ts, body),
        }


async def _drive(url: str, calls: _Calls, result: LoadResult, seed: int) -> None:
    n = round(result.rate * result.duration_s)
    rnd = random.Random(seed + 1)  # noqa: S311 - a load mix, not a secret
    kinds = rnd.choices(KINDS, weights=[MIX[k] for k in KINDS], k=n)
    # Idle connections are dropped by the client before uvicorn's 5 s keep-alive timeout, so a
    # call never races the server closing the connection it was sent on.
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=90) as client:
        await asyncio.gather(*(client.get("/healthz") for _ in range(20)))  # warm connections
        loop = asyncio.get_running_loop()

        async def one(kind: str, scheduled: float) -> None:
            body, headers, valid = calls.make(kind)
            if valid is not None:
                result.boots.add(valid)
            try:
                response = await client.post("/reboot", content=body, headers=headers)
                status: int | str = response.status_code
                result.statuses[response.status_code] += 1
            except httpx.HTTPError as exc:
                status = type(exc).__name__
                result.transport_errors[status] += 1
                if len(result.error_examples) < 5:
                    result.error_examples.append(f"{kind}: {status}: {exc}")
            result.latencies_ms.append((loop.time() - scheduled) * 1000)
            result.by_kind.setdefault(kind, Counter())[status] += 1

        start = loop.time() + 0.1
        tasks = []
        for i, kind in enumerate(kinds):
            scheduled = start + i / result.rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            result.max_send_lag_ms = max(result.max_send_lag_ms, (loop.time() - scheduled) * 1000)
            result.sent[kind] += 1
            tasks.append(asyncio.create_task(one(kind, scheduled)))
        result.send_span_s = loop.time() - start
        await asyncio.gather(*tasks)
        result.wall_s = loop.time() - start


def run_load(
    rate: float = 200.0, duration_s: float = 10.0, boots: int = 8, seed: int = 1
) -> LoadResult:
    """Start the service, drive it, stop it; what happened, with the events it emitted."""
    secret = secrets.token_hex(32)
    tmp = tempfile.TemporaryDirectory(prefix="vrd-webhook-load-")
    config = _config(f"load{uuid.uuid4().hex[:6]}", secret, Path(tmp.name) / "spool")
    rnd = random.Random(seed)  # noqa: S311 - made-up boot ids
    pairs = [
        (NODES[i % len(NODES)], str(uuid.UUID(int=rnd.getrandbits(128), version=4)))
        for i in range(boots)
    ]
    result = LoadResult(rate, duration_s, cluster=config.name)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tmp:
        log_path = str(Path(tmp.name) / "service.log")
        ctx = multiprocessing.get_context("spawn")
        service = ctx.Process(target=_serve, args=(config, port, log_path), name="webhook")
        service.start()
        try:
            _wait_healthy(url, service, log_path)
            calls = _Calls(secret, pairs, config.webhook.replay_window_s, seed)
            result.load_before = os.getloadavg()[0]
            cpu = time.process_time()
            asyncio.run(_drive(url, calls, result, seed))
            result.client_cpu_s = time.process_time() - cpu
            result.healthy_after = _healthy(url)
            result.service_cpu_s = _cpu_s(service.pid)
            result.load_after = os.getloadavg()[0]
        finally:
            if service.pid is not None and service.is_alive():
                os.kill(service.pid, signal.SIGTERM)  # uvicorn's graceful shutdown
            service.join(30)
            if service.is_alive():
                service.kill()
                service.join(5)
        spooled = (Path(tmp.name) / "spool" / config.name).glob("*.json")
        emitted = [json.loads(path.read_bytes()) for path in spooled]
        # The nodes' events, one per accepted boot; the cluster's own (every node back from
        # its reboot, see deployments/reboot_rounds.py) apart.
        result.events = [e for e in emitted if e["event"] == EVENT_REBOOTED]
        result.cluster_events = [e for e in emitted if e["event"] != EVENT_REBOOTED]
        result.refusals_logged = Path(log_path).read_text().count("refused a call")
    return result


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_healthy(url: str, service: Any, log_path: str) -> None:
    deadline = time.monotonic() + 60
    while not _healthy(url):
        if not service.is_alive() or time.monotonic() > deadline:
            log = Path(log_path).read_text() if Path(log_path).exists() else ""
            raise RuntimeError(f"the webhook service did not start on {url}:\n{log[-2000:]}")
        time.sleep(0.1)


def summary(result: LoadResult) -> str:
    """One line for the terminal."""
    return (
        f"{result.total} calls, answered at {result.achieved_rate:.0f}/s: "
        f"p50 {result.percentile(50):.1f} ms, p95 {result.percentile(95):.1f} ms, "
        f"p99 {result.percentile(99):.1f} ms, "
        f"max {max(result.latencies_ms, default=float('nan')):.1f} ms; "
        f"statuses {dict(sorted(result.statuses.items()))}; "
        f"transport errors {sum(result.transport_errors.values())}; "
        f"{len(result.events)} events, {len({e['id'] for e in result.events})} distinct ids"
    )


def report_lines(result: LoadResult) -> list[str]:
    ids = [e["id"] for e in result.events]
    accepted = result.by_kind.get("valid", Counter())[202]
    valid_boots = {boot for _, boot in result.boots}
    stray = [e for e in result.events if e["payload"]["boot_id"] not in valid_boots]
    n = max(result.total, 1)
    lines = [
        f"# Reboot webhook under load ({result.rate:g} calls/s for {result.duration_s:g} s, "
        "open loop)",
        "",
        "`serve_webhook` (uvicorn, access log on, as `vllm-redeploy webhook` runs) in its own "
        "process on 127.0.0.1, each event kept in its spool (fsynced before the 202; nothing "
        "forwards it during the run); one asyncio client "
        "process (httpx, keep-alive, idle connections closed after 2 s, up to 100 connections). "
        "Latency counts from each call's scheduled send time, so time a call waited behind others "
        "is included. This machine: "
        f"{os.cpu_count()} cores shared with other work (load average {result.load_before:.1f} "
        f"before the run, {result.load_after:.1f} after), so the figures are noisy.",
        "",
        "| calls | scheduled /s | sent /s | answered /s | p50 ms | p95 ms | p99 ms | max ms "
        "| transport errors | 5xx |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {result.total} | {result.rate:g} | {result.send_rate:.1f} | {result.achieved_rate:.1f} "
        f"| {result.percentile(50):.1f} | {result.percentile(95):.1f} "
        f"| {result.percentile(99):.1f} | {max(result.latencies_ms, default=float('nan')):.1f} "
        f"| {sum(result.transport_errors.values())} | {result.server_errors} |",
        "",
        "| kind | sent | answers |",
        "| --- | --- | --- |",
    ]
    for kind in KINDS:
        answers = ", ".join(
            f"{s}: {n}" for s, n in sorted(result.by_kind.get(kind, {}).items(), key=str)
        )
        lines.append(f"| {kind} | {result.sent[kind]} | {answers} |")
    lines += [
        "",
        f"Events: the service emitted {len(ids)} (one per call it accepted: {accepted} valid "
        f"calls got 202) with {len(set(ids))} distinct ids for the {len(result.boots)} distinct "
        f"node/boot pairs sent (ids as derived from cluster, node and boot: "
        f"{'yes' if set(ids) == result.expected_event_ids else 'NO'}); "
        f"{len(stray)} for the {result.sent['replayed'] + result.sent['forged']} replayed and "
        f"forged calls. The service itself does not deduplicate: Prefect drops an event whose id "
        f"it already has, so it would store {len(set(ids))}.",
        "",
        f"CPU: the service {result.service_cpu_s:.2f} s (start-up included, "
        f"{1000 * result.service_cpu_s / n:.2f} ms per call), the load generator "
        f"{result.client_cpu_s:.2f} s ({1000 * result.client_cpu_s / n:.2f} ms per call). "
        f"The generator fell behind its schedule by at most {result.max_send_lag_ms:.0f} ms. "
        f"The service answered /healthz afterwards: {'yes' if result.healthy_after else 'NO'}.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="calls per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--boots", type=int, default=8, help="distinct node/boot pairs")
    args = parser.parse_args()
    result = run_load(args.rate, args.duration, args.boots)
    print(summary(result), file=sys.stderr)
    write_results("webhook_load", report_lines(result))


if __name__ == "__main__":
    main()
