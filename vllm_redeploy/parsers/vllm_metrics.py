"""vLLM's Prometheus metrics (`GET /metrics` on the API port), as far as telling a busy engine
from a stuck one needs (requests running and waiting, and the tokens it has processed) and the
watcher relays (the tokens generated, the KV cache's use).

The API server answers /metrics from its own process while the engine core is blocked, so the
gauges and counters are what the engine last reported: tokens that stop advancing while
requests run mean the engine stopped stepping."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# Counters: prompt tokens advance as prefills finish, generation tokens at every decode step.
TOKENS = ("vllm:prompt_tokens", "vllm:generation_tokens")
GENERATED = "vllm:generation_tokens"
# 0..1 per engine; vLLM before V1 called it gpu_cache_usage_perc.
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True)
class EngineCounters:
    running: int
    waiting: int
    tokens: float  # prompt plus generated tokens since the engine started
    generated: float = 0.0  # generated tokens since the engine started
    kv_cache_usage: float | None = None  # the fullest engine's KV cache, 0..1; None: not given


def parse_metrics(text: str) -> EngineCounters:
    """The sums over every engine and model label; raises ValueError on text that is not
    Prometheus' exposition format or lacks vLLM's metrics."""
    sums: dict[str, float] = {}
    kv: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (RUNNING, WAITING) or (
                family.name in TOKENS and sample.name.endswith("_total")
            ):
                key = family.name if family.name in TOKENS else sample.name
                sums[key] = sums.get(key, 0.0) + sample.value
            elif sample.name in KV_CACHE:
                kv.append(sample.value)
    missing = [name for name in (RUNNING, WAITING, *TOKENS) if name not in sums]
    if missing:
        raise ValueError(f"no {', '.join(missing)} in the metrics")
    return EngineCounters(
        int(sums[RUNNING]),
        int(sums[WAITING]),
        sum(sums[name] for name in TOKENS),
        sums[GENERATED],
        max(kv) if kv else None,
    )
