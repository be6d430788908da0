"""The redeploy flow on beds of other kinds and sizes: GB10 nodes, and 8 nodes as a real cluster
mid-upgrade would be.

A module of its own, so the 8 Ray nodes do not start beside a group that a module-wide bed keeps
serving on the same 2 cores: each Ray node must register within Ray's own 30 s, and this row once
timed out starting a Ray worker under load."""

from __future__ import annotations

import pytest

from tests.conftest import make_bed
from tests.test_flow import failure, run_flow
from tests.testbed import image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    ("nodes", "gpu", "first_ip", "backend"),
    [(2, "gb10", 51, "mp"), (8, "h200", 41, "ray")],
    ids=["gb10-2-nodes", "h200-8-nodes"],
)
def test_other_node_kinds_and_sizes(
    prefect_api: None, nodes: int, gpu: str, first_ip: int, backend: str
) -> None:
    """At 8 nodes as a real cluster mid-upgrade would be: NGC's image (its entrypoint kept),
    every other node's engine answering as Docker 29, OpenSSH's default session limits."""
    big = nodes == 8
    bed = make_bed(
        nodes, gpu, first_ip,
        vllm_image=image.NGC_IMAGE if big else image.BED_IMAGE,
        docker29=[f"node-{i}" for i in range(2, nodes + 1, 2)] if big else (),
        backend=backend,
    )  # fmt: skip
    try:
        state = run_flow(bed)
        assert state.is_completed(), failure(state)
        assert state.result()["probe"]["healthy"]
    finally:
        bed.down()
