"""The benchmark's meter of the product's own cost: which calls wait for each other, and that
every command the product runs on a node is seen (bench/cost.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.cost import Call, critical_path, metered
from vllm_redeploy.nodes.local import LocalRunner


def call(node: str, start: float, end: float) -> Call:
    return Call(node, "exec", start, end)


def test_calls_fanned_out_at_once_count_once_on_the_critical_path() -> None:
    fanned = [call(f"node-{i}", 0.0 + i * 0.01, 1.0 + i * 0.01) for i in range(8)]
    then = [call(f"node-{i}", 1.2, 2.0) for i in range(8)]
    assert critical_path(fanned) == 1
    assert critical_path(fanned + then) == 2


def test_calls_one_after_another_each_count() -> None:
    chain = [call("node-1", t, t + 0.5) for t in (0.0, 0.6, 1.2, 1.8)]
    beside = [call("node-2", 0.1, 1.9)]  # one long call overlapping them all
    assert critical_path(chain + beside) == 4
    assert critical_path([]) == 0


def test_the_meter_sees_each_command_and_which_waited_for_which() -> None:
    runners = [LocalRunner(f"node-{i}") for i in range(4)]
    with metered() as meter:
        began = time.time()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda r: r.run(["sleep", "0.2"]), runners))
        runners[0].run_all([["true"], ["echo", "x"]])  # one round trip
        runners[0].run(["true"])
        ended = time.time()
    cost = meter.cost(began, ended)
    assert cost.calls == 6
    assert cost.per_node_max == 3
    assert cost.critical == 3
    assert cost.critical_ssh == 3  # commands, no Docker requests
    assert cost.busy is not None and 0.0 <= cost.busy <= 1.0
    outside = meter.cost(ended + 1, ended + 2)
    assert outside.calls == 0


def test_requests_to_the_engine_count_and_prefects_do_not() -> None:
    api = "http://127.0.0.1:4200/api"
    client = httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(200)))
    with metered(api) as meter:
        began = time.time()
        client.get("http://127.0.0.85:8000/health")
        with client.stream("GET", "http://127.0.0.86:8000/v1/models") as answer:  # send(request=)
            answer.read()
        client.post(f"{api}/task_runs/filter")
        ended = time.time()
    assert [(c.node, c.kind) for c in meter.calls] == [
        ("127.0.0.85", "http"),
        ("127.0.0.86", "http"),
    ]
    cost = meter.cost(began, ended)
    assert (cost.critical, cost.critical_ssh) == (2, 0)  # requests, none over SSH
