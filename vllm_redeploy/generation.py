"""Does the engine still generate? A hung group answers 200 on /health and lists its model:
vLLM's mp executor waits VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s) for a lost or frozen rank,
and the Ray executor assumes its workers are healthy until a request fails. Only a generation
tells, and only the engine's own counters tell a stuck engine from a busy one.

One look sends a 1-token chat completion with a deadline, reading /metrics before and after: an
answer is healthy; no answer while tokens advanced is busy (other requests hold the engine);
no answer and no token processed meanwhile is stuck.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import httpx

from vllm_redeploy.answers import METRICS_CAP_BYTES, fetch
from vllm_redeploy.parsers.vllm_metrics import EngineCounters, parse_metrics
from vllm_redeploy.probe import bearer, chat_request, judge
from vllm_redeploy.safe_text import one_line

PROMPT = "Hi"
METRICS_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
Verdict = Literal["answered", "busy", "stuck", "failed"]


@dataclass(frozen=True)
class GenerationCheck:
    verdict: Verdict
    detail: str  # one line, for people
    elapsed_s: float

    @property
    def problem(self) -> str | None:
        """What keeps the group from being healthy, or None (answered, or busy)."""
        return self.detail if self.verdict in ("stuck", "failed") else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_generation(
    base_url: str, model: str, timeout_s: float, api_key: str | None = None
) -> GenerationCheck:
    """One 1-token generation against ``base_url`` (http://head:port), judged with the
    engine's counters when it gets no answer within ``timeout_s``; with ``api_key``, as vLLM's
    bearer token."""
    base = base_url.rstrip("/")
    started = time.monotonic()
    with httpx.Client(timeout=METRICS_TIMEOUT, headers=bearer(api_key)) as client:
        before = read_counters(client, base)
        try:
            response = fetch(
                client,
                "POST",
                f"{base}/v1/chat/completions",
                json=chat_request(model, PROMPT, 1, 0.0),
                timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
                deadline_s=timeout_s,
            )
        except httpx.TimeoutException:
            after = read_counters(client, base)
            return judge_silence(before, after, timeout_s, time.monotonic() - started)
        except httpx.HTTPError as exc:
            elapsed = time.monotonic() - started
            return GenerationCheck(
                "failed", f"a 1-token generation failed: {one_line(exc)}", elapsed
            )
    elapsed = time.monotonic() - started
    if response.status_code >= 400:
        verdict = judge(response.status_code, response.text)
        return GenerationCheck("failed", f"a 1-token generation failed: {verdict.detail}", elapsed)
    return GenerationCheck("answered", f"a 1-token generation answered in {elapsed:.1f} s", elapsed)


def read_counters(client: httpx.Client, base: str) -> EngineCounters | None:
    """The engine's counters now, or None when /metrics does not answer with them."""
    try:
        response = fetch(client, "GET", f"{base}/metrics", cap_bytes=METRICS_CAP_BYTES)
        return parse_metrics(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def judge_silence(
    before: EngineCounters | None,
    after: EngineCounters | None,
    timeout_s: float,
    elapsed_s: float,
) -> GenerationCheck:
    """No answer within ``timeout_s``: busy if the engine processed tokens meanwhile, else
    stuck."""
    if before is not None and after is not None and after.tokens > before.tokens:
        return GenerationCheck(
            "busy",
            f"busy: no 1-token answer within {timeout_s:g} s, but the engine processed "
            f"{after.tokens - before.tokens:g} tokens meanwhile ({_load(after)})",
            elapsed_s,
        )
    load = _load(after) if after is not None else "its /metrics did not answer"
    return GenerationCheck(
        "stuck",
        f"the engine hangs: a 1-token generation got no answer within {timeout_s:g} s and no "
        f"token was processed meanwhile ({load}) while /health may still answer 200: a rank "
        "is frozen or lost (vLLM itself gives up after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, "
        "300 s by default)",
        elapsed_s,
    )


def _load(counters: EngineCounters) -> str:
    running = "1 request" if counters.running == 1 else f"{counters.running} requests"
    return f"{running} running, {counters.waiting} waiting"
