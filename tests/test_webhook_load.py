"""The reboot webhook under load: the bench's own run (200 calls/s for 10 s, open loop, against
`serve_webhook` in its own process), checked for correctness rather than speed."""

from __future__ import annotations

import pytest

from bench.webhook_load import run_load, summary

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.mark.timeout(400)
def test_webhook_under_load_answers_every_call_correctly() -> None:
    result = run_load(rate=200, duration_s=10, boots=8)
    print(summary(result))  # the latency figures; bench/results/webhook_load.md keeps them
    assert result.total == 2000
    assert result.healthy_after, "the service stopped answering /healthz"
    assert result.server_errors == 0, result.statuses
    assert not result.transport_errors, (result.transport_errors, result.error_examples)
    assert sum(result.statuses.values()) == result.total  # every call got an answer
    # Every valid call accepted; every replayed and forged one refused with 401.
    assert result.by_kind["valid"] == {202: result.sent["valid"]}
    assert result.by_kind["replayed"] == {401: result.sent["replayed"]}
    assert result.by_kind["forged"] == {401: result.sent["forged"]}
    assert min(result.sent.values()) > 100  # each kind well represented
    # The service emits one event per distinct boot, however often a boot is reported (a retry
    # is answered 202 and queued once), and nothing from a replayed or forged call.
    ids = [e["id"] for e in result.events]
    # (Read from its spool after the run: nothing forwarded them meanwhile.)
    assert len(result.boots) == 8
    assert len(ids) == len(result.boots), f"{len(ids)} events for {len(result.boots)} boots"
    assert set(ids) == result.expected_event_ids
    valid_boots = {boot for _, boot in result.boots}
    assert all(e["payload"]["boot_id"] in valid_boots for e in result.events)
