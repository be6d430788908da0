"""The probe's judgement on vLLM's real response shapes (reasoning parser on and off, old and
new field names, error objects) and on what proxies and broken servers send."""

from __future__ import annotations

import json

import pytest

from vllm_redeploy.probe import judge

THINKING = "Thinking Process:\n\n1. **Analyze the Request:** the user wants a greeting."


def completion(message: dict, finish: str | None = "length") -> str:
    return json.dumps(
        {
            "id": "chatcmpl-1f0c",
            "object": "chat.completion",
            "created": 1764457000,
            "model": "Qwen3.5-122B-A10B-FP8",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "tool_calls": [], **message},
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 16, "total_tokens": 66, "completion_tokens": 50},
        }
    )


def test_budget_ending_inside_thinking_is_healthy() -> None:
    verdict = judge(200, completion({"content": None, "reasoning": THINKING}))
    assert verdict.healthy and verdict.content is None and verdict.reasoning == THINKING
    assert verdict.detail == "reasoning only: the token budget ended inside thinking"
    assert verdict.finish_reason == "length"


def test_the_old_field_name_is_read_too() -> None:
    verdict = judge(200, completion({"content": None, "reasoning_content": THINKING}))
    assert verdict.healthy and verdict.reasoning == THINKING


def test_transition_servers_sent_both_names() -> None:
    body = completion({"content": None, "reasoning": THINKING, "reasoning_content": THINKING})
    assert judge(200, body).reasoning == THINKING


def test_an_answer_with_content_is_healthy() -> None:
    verdict = judge(200, completion({"content": "Hello there!", "reasoning": THINKING}, "stop"))
    assert verdict.healthy and verdict.detail == "answered: Hello there!"


def test_without_a_parser_the_thinking_is_in_content() -> None:
    verdict = judge(200, completion({"content": "<think>\nThe user wants a greeting"}))
    assert verdict.healthy and verdict.content.startswith("<think>")


@pytest.mark.parametrize(
    "message",
    [
        {"content": None, "reasoning": None},
        {"content": "  \n", "reasoning": ""},
        {"content": None},
    ],
)
def test_nothing_at_all_is_unhealthy(message: dict) -> None:
    verdict = judge(200, completion(message, "stop"))
    assert not verdict.healthy and verdict.detail.startswith("empty answer")


def test_no_choices_is_unhealthy() -> None:
    body = json.dumps({"object": "chat.completion", "choices": []})
    assert judge(200, body).detail == "the reply has no choices"


def test_vllm_error_object_is_unhealthy_with_its_message() -> None:
    body = json.dumps(
        {
            "error": {
                "message": "The model `x` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
    )
    verdict = judge(404, body)
    assert not verdict.healthy and verdict.detail == "HTTP 404: The model `x` does not exist."


def test_older_vllm_error_shape_is_unhealthy() -> None:
    body = json.dumps(
        {
            "object": "error",
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    )
    assert judge(404, body).detail == "HTTP 404: The model `x` does not exist."


def test_a_proxy_html_page_is_unhealthy() -> None:
    body = "<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"
    verdict = judge(502, body)
    assert not verdict.healthy and "HTML page" in verdict.detail and "502" in verdict.detail


def test_truncated_json_is_unhealthy() -> None:
    verdict = judge(200, completion({"content": "Hi"})[:40])
    assert not verdict.healthy and "not JSON" in verdict.detail


def test_a_500_without_json_is_unhealthy_in_one_line() -> None:
    verdict = judge(500, "Internal Server Error\n\nTraceback ...")
    assert not verdict.healthy and "\n" not in verdict.detail


# What a model with NaNs in its FP8 kernels answers: one token over and over (vllm#17154 GLM-4,
# #13035 Llama-405B, #27364 Qwen3-VL on Jetson Thor), and answers that are healthy though short.
@pytest.mark.parametrize(
    ("message", "detail"),
    [
        ({"content": None, "reasoning": "!" * 50},
         "the model repeats '!' 50 times in its reasoning"),
        ({"content": "!!!!!!!!!!!!", "reasoning": THINKING},
         "the model repeats '!' 12 times in its content"),
        ({"content": None, "reasoning": " ".join(["the"] * 25)},
         "the model repeats 'the' 25 times in its reasoning"),
        ({"content": None, "reasoning": "<unk><unk><unk><unk><unk><unk><unk><unk><unk>"},
         "the model repeats '<unk>' 9 times in its reasoning"),
        ({"content": None, "reasoning": "?!. ,;: -- ... !?"},
         "the model answers only punctuation and symbols in its reasoning"),
        # Added and special tokens are as long as their vocabulary makes them: still a loop.
        ({"content": None, "reasoning": "<|reserved_special_token_42|>" * 10},
         "the model repeats '<|reserved_special_token_42|>' 10 times in its reasoning"),
        ({"content": "<|im_end|> " * 9, "reasoning": THINKING},
         "the model repeats '<|im_end|>' 9 times in its content"),
    ],
)  # fmt: skip
def test_an_answer_that_loops_on_one_token_is_unhealthy(message: dict, detail: str) -> None:
    verdict = judge(200, completion(message))
    assert not verdict.healthy, verdict
    assert (
        verdict.detail
        == f"{detail}: NaNs in the weights or kernels (FP8 on a new GPU is known for it)"
    )


@pytest.mark.parametrize(
    "message",
    [
        {"content": None, "reasoning": THINKING},
        {"content": "4", "reasoning": None},
        {"content": "OK", "reasoning": None},
        {"content": "Hello! How can I help you today?", "reasoning": THINKING},
        # The real vLLM 0.32.0 (CPU build) on the bed's tiny model, as it answered the probe.
        {"content": None, "reasoning": "ordembedchretithgeforOM user embed from Thinking model"},
        {"content": None, "reasoning": "Hmm... 2 + 2 = 4. 4! Yes, 4."},
    ],
)  # fmt: skip
def test_short_and_plain_answers_stay_healthy(message: dict) -> None:
    verdict = judge(200, completion(message))
    assert verdict.healthy, verdict
