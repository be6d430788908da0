"""Step "sync": right after preflight, the nodes that lack the source's image or model files
(or hold another build under the image's tag) get them, streamed from the source node
(vllm_redeploy.sync); each target shows its progress in the UI while it copies."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, StepFailed, log
from tasks.records import Progress
from vllm_redeploy.names import artifact_key
from vllm_redeploy.nodes import RemoteError
from vllm_redeploy.summary import StepEvent, report
from vllm_redeploy.sync import (
    Copied,
    SyncNeed,
    human_bytes,
    planned_bytes,
    route_between,
    sync_target,
)

STEP = "sync"
UPDATE_S = 1.0  # how often the UI's progress moves (each update is an API call)


class Meter:
    """One target's bytes, shown in the UI (a progress artifact) and to a CLI listening, at most
    once per UPDATE_S."""

    def __init__(self, node: str, total: int, progress: Progress) -> None:
        self.node, self.total, self.progress = node, total, progress
        self.started = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < UPDATE_S:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-3)
        left = (self.total - done) / rate if rate > 0 and self.total > done else 0
        text = (
            f"{self.node}: {human_bytes(done)} of {human_bytes(self.total)}, "
            f"{human_bytes(rate)}/s, {left:.0f} s left"
        )
        report(StepEvent(STEP, "copying", detail=text))
        percent = min(99.0, 100.0 * done / self.total) if self.total else 99.0
        self.progress.set(percent, text)


# Not cached and not retried: what a node holds changes between runs, and a copy cut halfway
# is resumed by the next run (the model's finished files stay), not by copying again at once.
@task(name="sync", task_run_name="sync[{name}]", cache_policy=NO_CACHE)
def sync_node(run: Run, name: str, need: SyncNeed, image_id: str | None) -> list[Copied]:
    """Copy what ``need`` names from the source to node ``name``."""
    config = run.config
    source, target = run.node(config.sync_source.name), run.node(name)
    try:
        route = route_between(source, target, config)
        log().info("%s, %s", need.describe(config.vllm.image), route)
        total = planned_bytes(source, need, config.vllm.image if image_id else None)
        progress = Progress(
            run.records,
            artifact_key(config.name, f"sync-{name}"),
            f"{name}: {human_bytes(total)} from {source.name}, {route}",
        )
        progress.set(0.0)
        copied = sync_target(
            source, target, config, need, image_id, route, Meter(name, total, progress)
        )
    except RemoteError as exc:
        raise StepFailed(STEP, f"{exc} (what {name} held before is still there)") from None
    progress.set(100.0, f"{name}: done")
    for done in copied:
        log().info(
            "%s: %s, %s in %.1f s (%s), %s already there, %s",
            name,
            done.what,
            human_bytes(done.bytes),
            done.seconds,
            done.rate,
            human_bytes(done.already),
            done.route,
        )
    return copied
