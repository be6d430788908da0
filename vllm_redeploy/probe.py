"""The reasoning-aware sanity probe: one chat completion, judged the way a reasoning model answers.

A reasoning model given a small budget spends it all thinking: ``content`` is null, the thinking
is in ``reasoning`` (``reasoning_content`` on servers before 2026) and ``finish_reason`` is
``"length"``. That is a healthy server, not an empty answer.

A broken one answers 200 too: NaNs in FP8 kernels make vLLM emit one token over and over
("!!!!!!!!" in most tokenizers; vllm#17154, #13035, #27364 on a Blackwell part), so an answer
whose text is one short unit repeated, or nothing but punctuation and symbols, is unhealthy.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from vllm_redeploy.answers import AnswerTooLarge, fetch
from vllm_redeploy.safe_text import one_line

DETAIL_CHARS = 200
MIN_REPEATS = 8  # a unit this many times over is a loop, not an answer
SHOWN_UNIT = 60  # characters of a repeated unit the verdict quotes


@dataclass(frozen=True)
class ProbeVerdict:
    healthy: bool
    detail: str  # one line: why healthy or not
    content: str | None = None
    reasoning: str | None = None
    finish_reason: str | None = None
    status_code: int | None = None
    elapsed_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def chat_request(model: str, prompt: str, max_tokens: int, temperature: float) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that carries vLLM's API key (``--api-key``/VLLM_API_KEY); none without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def judge(status_code: int, body: str, elapsed_s: float | None = None) -> ProbeVerdict:
    """Judge one /v1/chat/completions reply (status and raw body)."""

    def bad(detail: str) -> ProbeVerdict:
        return ProbeVerdict(False, detail, status_code=status_code, elapsed_s=elapsed_s)

    try:
        data = json.loads(body)
    except ValueError:
        kind = "an HTML page" if body.lstrip()[:1] == "<" else "not JSON"
        return bad(f"HTTP {status_code} and the body is {kind}: {_excerpt(body)}")
    if not isinstance(data, dict):
        return bad(f"HTTP {status_code} and the body is JSON but not an object: {_excerpt(body)}")
    error = _error_message(data)
    if error is not None or status_code >= 400:
        return bad(f"HTTP {status_code}: {_excerpt(error or body)}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return bad("the reply has no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content = _text(message.get("content"))
    reasoning = _text(message.get("reasoning")) or _text(message.get("reasoning_content"))
    finish = choice.get("finish_reason")
    found = {
        "content": content,
        "reasoning": reasoning,
        "finish_reason": finish,
        "status_code": status_code,
        "elapsed_s": elapsed_s,
    }
    for field, text in (("content", content), ("reasoning", reasoning)):
        if text and (why := garbage(text)):
            detail = f"the model {why} in its {field}: NaNs in the weights or kernels"
            return ProbeVerdict(False, f"{detail} (FP8 on a new GPU is known for it)", **found)
    if content:
        return ProbeVerdict(True, f"answered: {_excerpt(content, 80)}", **found)
    if reasoning:
        if finish == "length":
            detail = "reasoning only: the token budget ended inside thinking"
        else:
            detail = f"reasoning only (finish_reason {finish!r})"
        return ProbeVerdict(True, detail, **found)
    return ProbeVerdict(
        False, f"empty answer: no content and no reasoning (finish_reason {finish!r})", **found
    )


def garbage(text: str) -> str | None:
    """Why ``text`` is what a broken model emits ("repeats '!' 50 times", "answers only
    punctuation"), or None for an answer. A loop is a unit of any length (an added or special
    token can be dozens of characters) that tiles the whole text MIN_REPEATS times or more."""
    flat = text.strip()
    period = _shortest_period(flat)
    if period and len(flat) // period >= MIN_REPEATS:
        word = flat[:period].strip()
        count = flat.count(word)
        return f"repeats {_excerpt(word, SHOWN_UNIT)!r} {count} times"
    if flat and not any(unicodedata.category(c)[0] in "LN" for c in flat):
        return "answers only punctuation and symbols"
    return None


def _shortest_period(text: str) -> int:
    """The shortest p such that ``text`` is its first p characters over and over (the last
    time perhaps cut short): Knuth-Morris-Pratt's failure function, in one pass."""
    border = [0] * len(text)
    for i in range(1, len(text)):
        k = border[i - 1]
        while k and text[i] != text[k]:
            k = border[k - 1]
        border[i] = k + (text[i] == text[k])
    return len(text) - border[-1] if text else 0


def run_probe(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    timeout_s: float,
    api_key: str | None = None,
) -> ProbeVerdict:
    """Send the probe to ``base_url`` (e.g. http://head:30000) and judge the reply; with
    ``api_key``, as vLLM's bearer token."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
    try:
        with httpx.Client(timeout=timeout, headers=bearer(api_key)) as client:
            response = fetch(
                client,
                "POST",
                url,
                json=chat_request(model, prompt, max_tokens, temperature),
                deadline_s=timeout_s,
            )
    except httpx.TimeoutException:
        return ProbeVerdict(False, f"no reply from {url} within {timeout_s:g} s")
    except AnswerTooLarge as exc:
        return ProbeVerdict(False, str(exc))
    except httpx.HTTPError as exc:
        return ProbeVerdict(False, f"cannot reach {url}: {one_line(exc)}")
    return judge(response.status_code, response.text, response.elapsed_s)


def _text(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return value
    return None


def _error_message(data: dict[str, Any]) -> str | None:
    error = data.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if isinstance(error, str):
        return error
    if data.get("object") == "error":  # servers before the OpenAI-style error object
        return str(data.get("message", "error"))
    return None


def _excerpt(text: str, limit: int = DETAIL_CHARS) -> str:
    flat = one_line(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
