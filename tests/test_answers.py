"""Answers over HTTP are read whole within a deadline and a byte cap, against a real socket that
trickles its headers or its body a byte at a time, or sends too much."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.testbed.trickler import answer, server, trickle, trickle_after_headers
from vllm_redeploy.answers import AnswerTooLarge, fetch


def test_an_answer_is_read_whole() -> None:
    served = server(lambda conn: conn.sendall(answer(b'{"data": []}')))
    with served as url, httpx.Client(timeout=2.0) as client:
        got = fetch(client, "GET", f"{url}/v1/models")
    assert (got.status_code, got.json(), got.text) == (200, {"data": []}, '{"data": []}')


@pytest.mark.parametrize(
    "where",
    [
        "headers",  # the status line and headers a byte at a time: h11 waits for all of them
        "body",
    ],
)
def test_a_trickle_ends_at_the_deadline_though_every_byte_comes_in_time(where: str) -> None:
    data = answer(b'{"data": []}' + b" " * 200)
    serve = trickle(data) if where == "headers" else trickle_after_headers(data)
    with server(serve) as url, httpx.Client(timeout=httpx.Timeout(1.0)) as client:
        began = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match=r"within 1\.5 s"):
            fetch(client, "GET", f"{url}/v1/models", deadline_s=1.5)
        took = time.monotonic() - began
    assert took < 3.0, took  # the per-read timeout alone (1 s, a byte every 0.2 s) never fires


def test_an_answer_past_its_cap_is_refused() -> None:
    served = server(lambda conn: conn.sendall(answer(b"x" * 300_000)))
    with served as url, httpx.Client(timeout=2.0) as client:
        with pytest.raises(AnswerTooLarge, match="larger than 256 KiB"):
            fetch(client, "GET", f"{url}/metrics", cap_bytes=256 * 1024)
        assert len(fetch(client, "GET", f"{url}/metrics").content) == 300_000
