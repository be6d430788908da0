"""What Prefect itself costs for a flow of the redeploy's shape: the same task runs, doing nothing.

The shape is read from a measured redeploy: its task runs in start order, grouped where
consecutive runs are the same step (``preflight[node-1]``, ``preflight[node-2]``, ...). The
mirror submits each group's tasks together and waits for them, as the real flow does, then writes
one markdown artifact and emits one event, as the real flow's ending does. Its wall time against
the same server is Prefect's bookkeeping: creating the flow run and task runs, their state
changes, the artifact and the event; nothing of SSH, Docker or Ray.
"""

from __future__ import annotations

import time

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.futures import wait

from bench.flowruns import TaskSpan

Shape = list[list[str]]  # groups of task run names, in order


def shape_of(tasks: list[TaskSpan]) -> Shape:
    groups: Shape = []
    last_step = None
    for span in sorted(tasks, key=lambda s: s.start):
        if span.step == last_step:
            groups[-1].append(span.name)
        else:
            groups.append([span.name])
            last_step = span.step
    return groups


@task(name="noop", task_run_name="{label}", cache_policy=NO_CACHE)
def noop(label: str) -> str:
    return label


@flow(name="bench-bookkeeping")
def mirror(shape: Shape) -> int:
    done = 0
    for group in shape:
        futures = [noop.submit(label) for label in group]
        wait(futures)
        done += len([f.result() for f in futures])
    create_markdown_artifact("no-op mirror of a redeploy", key="bench-bookkeeping")
    emit_event("bench.bookkeeping.done", resource={"prefect.resource.id": "bench.bookkeeping"})
    return done


def bookkeeping_s(shape: Shape) -> float:
    started = time.time()
    mirror(shape)
    return time.time() - started
