"""The watcher's metrics as Prometheus reads them: names, labels and values from the facts of
a look and a run, through the client library's own exposition and parser."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import REASONS, VERDICTS, LookFacts, RunFacts, WatchMetrics
from vllm_redeploy.parsers.vllm_metrics import EngineCounters


def scraped(metrics: WatchMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_look_and_a_run_become_series_with_few_labels() -> None:
    metrics = WatchMetrics()
    metrics.looked(
        "pair",
        LookFacts(
            "unhealthy", frozenset({"not_running"}), 2, 1_700_000_000.0, 0.4,
            {"spark-a": False, "spark-b": True}, 0.25,
            EngineCounters(3, 1, 900.0, generated=700.0, kv_cache_usage=0.5),
        ),
    )  # fmt: skip
    metrics.looked("pair", LookFacts("healthy", frozenset(), 0, 1_700_000_015.0, 0.3, {}, None))
    metrics.ran(
        "pair",
        RunFacts(
            False, 1_699_999_000.0, 95.0, 80.0, 2, {"preflight": 1.5, "probe": 0.5}, 0.4,
            ("instanttensor", 412.5),
        ),
    )  # fmt: skip
    found = scraped(metrics)
    cluster = (("cluster", "pair"),)

    def one(name: str, **labels: str) -> float:
        return found[(name, tuple(sorted({"cluster": "pair", **labels}.items())))]

    # The last look wins: every verdict and reason is a series, 1 for what was seen.
    assert [one("vllm_redeploy_cluster_verdict", verdict=v) for v in VERDICTS] == [1, 0, 0, 0, 0]
    assert all(one("vllm_redeploy_cluster_problem", reason=r) == 0 for r in REASONS)
    assert found[("vllm_redeploy_looks_total", cluster)] == 2
    assert found[("vllm_redeploy_last_look_timestamp_seconds", cluster)] == 1_700_000_015.0
    assert ("vllm_redeploy_generation_latency_seconds", cluster) not in found  # none answered
    assert ("vllm_redeploy_engine_requests_running", cluster) not in found  # no engine seen
    assert found[("vllm_redeploy_last_run_success", cluster)] == 0
    assert found[("vllm_redeploy_last_run_duration_seconds", cluster)] == 95.0
    assert found[("vllm_redeploy_served_after_seconds", cluster)] == 80.0
    assert found[("vllm_redeploy_recoveries", cluster)] == 2
    assert one("vllm_redeploy_served_run_step_duration_seconds", step="preflight") == 1.5
    assert one("vllm_redeploy_served_run_step_duration_seconds", step="probe") == 0.5
    assert found[("vllm_redeploy_probe_latency_seconds", cluster)] == 0.4
    assert one("vllm_redeploy_weights_load_seconds", loader="instanttensor") == 412.5


def test_the_engines_figures_are_relayed_under_the_clusters_label() -> None:
    metrics = WatchMetrics()
    metrics.looked(
        "pair",
        LookFacts(
            "unhealthy", frozenset({"hang", "not_running"}), 1, 1.0, 0.4,
            {"spark-a": False, "spark-b": True}, 0.25,
            EngineCounters(3, 1, 900.0, generated=700.0, kv_cache_usage=0.5),
        ),
    )  # fmt: skip
    found = scraped(metrics)
    cluster = (("cluster", "pair"),)
    assert found[("vllm_redeploy_engine_requests_running", cluster)] == 3
    assert found[("vllm_redeploy_engine_requests_waiting", cluster)] == 1
    assert found[("vllm_redeploy_engine_kv_cache_usage_ratio", cluster)] == 0.5
    assert found[("vllm_redeploy_engine_generation_tokens_total", cluster)] == 700
    assert found[("vllm_redeploy_generation_latency_seconds", cluster)] == 0.25
    problems = {
        dict(labels)["reason"]
        for (name, labels), value in found.items()
        if name == "vllm_redeploy_cluster_problem" and value == 1
    }
    assert problems == {"hang", "not_running"}
    assert found[("vllm_redeploy_node_up", (("cluster", "pair"), ("node", "spark-a")))] == 0
    assert found[("vllm_redeploy_node_up", (("cluster", "pair"), ("node", "spark-b")))] == 1
    names = {name for name, _ in found}
    assert all(n.startswith("vllm_redeploy_") for n in names)


REPO = Path(__file__).parents[1]


def test_the_compose_profile_scrapes_the_watcher_and_provisions_the_dashboard() -> None:
    """compose.yaml's observability profile: Prometheus scrapes the port the watcher serves,
    Grafana's data source has the uid every panel names, and the dashboard is mounted where
    the provider looks."""
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    command = services["watcher"]["command"]
    port = command[command.index("--metrics") + 1].rpartition(":")[2]
    scrape = yaml.safe_load((REPO / "deployments/compose/prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"watcher:{port}"]
    assert {services[n]["profiles"][0] for n in ("prometheus", "grafana")} == {"observability"}
    grafana = REPO / "deployments/compose/grafana"
    (source,) = yaml.safe_load((grafana / "datasources.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads((REPO / "deployments/grafana/vllm-redeploy.json").read_text())
    named = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert named == {source["uid"]}
    (provider,) = yaml.safe_load((grafana / "dashboards.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./deployments/grafana/vllm-redeploy.json"].startswith(
        provider["options"]["path"]
    )
    assert all(
        not port.startswith("0.0.0.0") for s in services.values() for port in s.get("ports", [])
    )
