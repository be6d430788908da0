"""How the Ray launch settles when a node's `ray start` exits: a worker whose raylet registered too
late for Ray's fixed 30 s is started once more; a second exit, or the head's, fails the step."""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
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
from vllm_redeploy.launch.ray_settle import RayStarts, wait_members

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
    deadline = time.monotonic() + within_s
    docker_of = lambda name: run.node(name).docker  # noqa: E731
    starts = RayStarts(run.config, docker_of, logging.getLogger("ray-settle-test"), names)
    while starts.pending and time.monotonic() < deadline:
        starts.settle(deadline - time.monotonic())
    return sorted(starts.pending), starts.again


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


def started_ray(bed: TestBed, run: Run, node: int, python3: str = "") -> None:
    """A node's Ray container that says Ray started; on the head, ``python3`` (a shell script)
    answers the member list in Ray's place."""
    shim = (
        f"mkdir -p /shim && printf '%s\\n' '#!/bin/sh' {shlex.quote(python3)} > /shim/python3 && "
        "chmod +x /shim/python3 && "
        if python3
        else ""
    )
    with contextlib.closing(bed.nodes[node].engine.client()) as client:
        client.containers.run(
            image.OLD_STACK_IMAGE,
            ["sh", "-c", f'{shim}echo "Ray runtime started."; exec sleep 600'],
            name=ray_container(run.config),
            environment={"PATH": "/shim:/usr/local/bin:/usr/bin:/bin"},
            detach=True,
        )


def members_json(run: Run) -> str:
    members = [{"ip": n.ip, "alive": True, "gpus": n.gpus} for n in run.config.nodes]
    return json.dumps(members)


def test_a_member_read_killed_by_a_signal_is_asked_again(bed: TestBed, run: Run) -> None:
    """The read of Ray's members runs Python in the head's container, while every node's Ray
    starts: on a head short of memory the kernel's OOM killer may end it (exit 137). That says
    nothing about Ray; the next look asks again. A read that fails on its own is final."""
    killed_once = (
        "if [ -e /read-once ]; then echo " + shlex.quote(members_json(run)) + "; exit 0; fi; "
        "touch /read-once; kill -9 $$"
    )
    started_ray(bed, run, 0, killed_once)
    started_ray(bed, run, 1)
    docker_of = lambda name: run.node(name).docker  # noqa: E731
    log = logging.getLogger("ray-settle-test")
    members = wait_members(run.config, docker_of, log)
    assert sorted(m.ip for m in members) == sorted(n.ip for n in run.config.nodes)
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            client.containers.get(ray_container(run.config)).remove(force=True)
    started_ray(bed, run, 0, "echo 'ModuleNotFoundError: No module named ray' >&2; exit 1")
    started_ray(bed, run, 1)
    began = time.monotonic()
    with pytest.raises(SettleFailed) as failed:
        wait_members(run.config, docker_of, log)
    assert "No module named ray" in str(failed.value)
    assert time.monotonic() - began < run.config.deadlines.ray_cluster_s / 2  # not the window
