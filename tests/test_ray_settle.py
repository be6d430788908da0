"""How the Ray launch settles when a node's `ray start` exits: a worker whose raylet registered too
late for Ray's fixed 30 s is started once more; a second exit, or the head's, fails the step."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator

import pytest

from tasks.context import Run
from tests.testbed import image
from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config
from vllm_redeploy.launch.backend import SettleFailed
from vllm_redeploy.launch.ray import ray_container
from vllm_redeploy.launch.ray_settle import still_starting

pytestmark = pytest.mark.integration
LATE = (
    "Exception: The current node timed out during startup. This could happen because some of "
    "the raylet failed to startup or the GCS has become overloaded."
)
# Late the first time only: the container's own disk remembers the first start.
LATE_ONCE = (
    'if [ -e /started-once ]; then echo "Ray runtime started."; exec sleep 600; fi; '
    f'touch /started-once; echo "{LATE}"; exit 1'
)
LATE_ALWAYS = f'echo "{LATE}"; exit 1'


@pytest.fixture
def run(bed: TestBed, prefect_api: str) -> Iterator[Run]:
    path = bed.write_config(bed.root / "settle.toml", name=f"st{uuid.uuid4().hex[:6]}")  # type: ignore[arg-type]
    run = Run(load_config(path, env_file=None))
    try:
        yield run
    finally:
        for node in bed.nodes:
            with contextlib.closing(node.engine.client()) as client, contextlib.suppress(Exception):
                client.containers.get(ray_container(run.config)).remove(force=True)
        run.close()


def exited_ray(bed: TestBed, run: Run, node: int, script: str) -> None:
    """A node's Ray container that has exited, saying what ``script`` says."""
    with contextlib.closing(bed.nodes[node].engine.client()) as client:
        made = client.containers.run(
            image.OLD_STACK_IMAGE, ["sh", "-c", script], name=ray_container(run.config), detach=True
        )
        made.wait(timeout=30)


def settle(run: Run, names: list[str], within_s: float = 30) -> tuple[list[str], set[str]]:
    """The nodes still starting after ``within_s``, and those started a second time."""
    again: set[str] = set()
    deadline = time.monotonic() + within_s
    docker_of = lambda name: run.node(name).docker  # noqa: E731
    log = logging.getLogger("ray-settle-test")
    while (
        pending := still_starting(run.config, docker_of, names, again, log)
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pending, again


def test_a_worker_late_for_rays_30_s_is_started_once_more(bed: TestBed, run: Run) -> None:
    exited_ray(bed, run, 1, LATE_ONCE)
    assert settle(run, ["node-2"]) == ([], {"node-2"})


def test_late_twice_or_on_the_head_fails_the_step(bed: TestBed, run: Run) -> None:
    exited_ray(bed, run, 1, LATE_ALWAYS)
    with pytest.raises(SettleFailed) as twice:
        settle(run, ["node-2"])
    said = str(twice.value)
    assert "Ray on node-2 (worker, " in said
    assert said.count("timed out during startup") == 2  # started once more, then given up
    exited_ray(bed, run, 0, LATE_ALWAYS)
    with pytest.raises(SettleFailed) as head:
        settle(run, ["node-1"])
    assert "Ray on node-1 (head, " in str(head.value)
    assert str(head.value).count("timed out during startup") == 1  # the head: never again
