"""The watcher's metrics, for Prometheus: what it saw at its last look of each cluster, the
cluster's last run, and the engine's own figures relayed under our labels.

Served from the watcher's process (``vllm-redeploy watch --metrics``): it holds every cluster's
latest look, so a scrape sends nothing to a node, to the engine or to Prefect. A service of its
own would have to look again (twice the requests to the engine) or reach into the watcher.

Every label value comes from a closed set (the verdicts, the kinds of problem) or from the
configuration (cluster and node names): the series stay few whatever happens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.parsers.vllm_metrics import EngineCounters
from vllm_redeploy.status import ClusterStatus, running_plan

PREFIX = "vllm_redeploy"
VERDICTS = ("healthy", "unhealthy", "busy", "paused", "crashlooping")
# What kept the cluster from being healthy, by kind: the label set of a problem.
REASONS = ("unreachable", "not_running", "api_down", "wrong_model", "health", "hang", "other")


@dataclass(frozen=True)
class LookFacts:
    """One look at a cluster, as the metrics show it."""

    verdict: str  # one of VERDICTS
    reasons: frozenset[str]  # of REASONS; empty when healthy
    bad_looks: int  # in a row
    at: float  # Unix time of the look
    seconds: float  # how long the look took
    nodes: dict[str, bool]  # node -> up (reached, and its members of the group running)
    generation_s: float | None = None  # the last 1-token generation's latency, if it answered
    engine: EngineCounters | None = None


@dataclass(frozen=True)
class RunFacts:
    """The cluster's last run that ended, and its recoveries in the watch window."""

    completed: bool
    ended_at: float  # Unix time
    seconds: float
    served_after_s: float | None = None  # start to served, for the last run that served
    recoveries: int = 0
    steps: dict[str, float] | None = None  # step -> seconds, of the last run that served
    probe_s: float | None = None  # its probe's answer time
    weights: tuple[str, float] | None = None  # its loader, and vLLM's seconds for the weights


def reasons_of(status: ClusterStatus, up: dict[str, bool]) -> frozenset[str]:
    """The kinds of problem in ``status`` (``up``: its nodes_up): a small, closed set, for a
    label."""
    found = set()
    for node in status.nodes:
        if not up[node.name]:
            found.add("unreachable" if not node.reachable or node.error else "not_running")
    endpoint = status.endpoint
    if endpoint.models is None:
        found.add("api_down")
    elif endpoint.served_name not in endpoint.models:
        found.add("wrong_model")
    elif endpoint.health != 200:
        found.add("health")
    if endpoint.generation is not None and endpoint.generation.problem:
        found.add("hang")
    if status.problems and not found:
        found.add("other")  # a changed launch, an orphaned follower, the group's own word
    return frozenset(found)


def nodes_up(config: ClusterConfig, status: ClusterStatus) -> dict[str, bool]:
    """Per node: reached, and every member of the group the plan puts there running."""
    plan = running_plan(config, [n.containers for n in status.nodes])
    up = {}
    for node in status.nodes:
        running = {c.name for c in node.containers if c.running}
        members = plan.on(node.name)
        up[node.name] = (
            node.reachable and not node.error and all(m.spec.name in running for m in members)
        )
    return up


class WatchMetrics(Collector):
    """The latest facts per cluster, turned into metric families at each scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._looks: dict[str, LookFacts] = {}
        self._counted: dict[str, int] = {}
        self._runs: dict[str, RunFacts] = {}

    def looked(self, cluster: str, facts: LookFacts) -> None:
        with self._lock:
            self._looks[cluster] = facts
            self._counted[cluster] = self._counted.get(cluster, 0) + 1

    def ran(self, cluster: str, facts: RunFacts) -> None:
        with self._lock:
            self._runs[cluster] = facts

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            looks, counted, runs = dict(self._looks), dict(self._counted), dict(self._runs)
        yield from _look_families(looks, counted)
        yield from _run_families(runs)
        yield from _engine_families(looks)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


def _look_families(looks: dict[str, LookFacts], counted: dict[str, int]) -> Iterator[Metric]:
    verdict = _gauge(
        "cluster_verdict",
        "The watcher's verdict at its last look: 1 for the verdict given, 0 for the others.",
        ["cluster", "verdict"],
    )
    problem = _gauge(
        "cluster_problem",
        "1 for each kind of problem the last look found, 0 for the others.",
        ["cluster", "reason"],
    )
    bad = _gauge("cluster_bad_looks", "Bad looks in a row, up to the last.", ["cluster"])
    last = _gauge(
        "last_look_timestamp_seconds", "When the watcher last looked (Unix time).", ["cluster"]
    )
    took = _gauge("look_duration_seconds", "How long the last look took.", ["cluster"])
    node_up = _gauge(
        "node_up",
        "1 when the node was reached and its members of the group run.",
        ["cluster", "node"],
    )
    generation = _gauge(
        "generation_latency_seconds",
        "The last 1-token generation's latency, when it answered.",
        ["cluster"],
    )
    total = CounterMetricFamily(
        f"{PREFIX}_looks", "Looks since the watcher started.", labels=["cluster"]
    )
    for cluster, facts in sorted(looks.items()):
        for name in VERDICTS:
            verdict.add_metric([cluster, name], float(facts.verdict == name))
        for name in REASONS:
            problem.add_metric([cluster, name], float(name in facts.reasons))
        bad.add_metric([cluster], facts.bad_looks)
        last.add_metric([cluster], facts.at)
        took.add_metric([cluster], facts.seconds)
        for node, up in facts.nodes.items():
            node_up.add_metric([cluster, node], float(up))
        if facts.generation_s is not None:
            generation.add_metric([cluster], facts.generation_s)
        total.add_metric([cluster], counted.get(cluster, 0))
    yield from (verdict, problem, bad, last, took, node_up, generation, total)


def _run_families(runs: dict[str, RunFacts]) -> Iterator[Metric]:
    success = _gauge("last_run_success", "1 when the last run that ended completed.", ["cluster"])
    ended = _gauge(
        "last_run_timestamp_seconds", "When the last run ended (Unix time).", ["cluster"]
    )
    took = _gauge("last_run_duration_seconds", "How long the last run took.", ["cluster"])
    served = _gauge(
        "served_after_seconds", "From the start of the last run that served to served.", ["cluster"]
    )
    recoveries = _gauge(
        "recoveries", "Recoveries started in the watch window ([watch] window_s).", ["cluster"]
    )
    step = _gauge(
        "served_run_step_duration_seconds",
        "Each step of the last run that served.",
        ["cluster", "step"],
    )
    probe = _gauge(
        "probe_latency_seconds", "The probe's answer time in the last run that served.", ["cluster"]
    )
    weights = _gauge(
        "weights_load_seconds",
        'vLLM\'s own time for the weights ("Loading weights took") in the last run that served, '
        "by the loader that read them.",
        ["cluster", "loader"],
    )
    for cluster, facts in sorted(runs.items()):
        success.add_metric([cluster], float(facts.completed))
        ended.add_metric([cluster], facts.ended_at)
        took.add_metric([cluster], facts.seconds)
        if facts.served_after_s is not None:
            served.add_metric([cluster], facts.served_after_s)
        recoveries.add_metric([cluster], facts.recoveries)
        for name, seconds in (facts.steps or {}).items():
            step.add_metric([cluster, name], seconds)
        if facts.probe_s is not None:
            probe.add_metric([cluster], facts.probe_s)
        if facts.weights is not None:
            weights.add_metric([cluster, facts.weights[0]], facts.weights[1])
    yield from (success, ended, took, served, recoveries, step, probe, weights)


def _engine_families(looks: dict[str, LookFacts]) -> Iterator[Metric]:
    running = _gauge("engine_requests_running", "The engine's requests running.", ["cluster"])
    waiting = _gauge("engine_requests_waiting", "The engine's requests waiting.", ["cluster"])
    kv = _gauge(
        "engine_kv_cache_usage_ratio", "The fullest engine's KV cache use, 0 to 1.", ["cluster"]
    )
    generated = CounterMetricFamily(
        f"{PREFIX}_engine_generation_tokens",
        "Tokens the engine generated since it started.",
        labels=["cluster"],
    )
    for cluster, facts in sorted(looks.items()):
        engine = facts.engine
        if engine is None:
            continue
        running.add_metric([cluster], engine.running)
        waiting.add_metric([cluster], engine.waiting)
        if engine.kv_cache_usage is not None:
            kv.add_metric([cluster], engine.kv_cache_usage)
        generated.add_metric([cluster], engine.generated)
    yield from (running, waiting, kv, generated)


def serve_metrics(metrics: WatchMetrics, host: str, port: int) -> WSGIServer:
    """Serve ``metrics`` at http://host:port/metrics on a thread of this process."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(metrics)
    server, _ = start_http_server(port, host, registry)
    return server
