"""Step 7, wait for ready: until /v1/models names our served model, while watching the engine.

The API port refuses connections for the whole load, so "loading or dead" is judged from the
engine container (alive, log moving), never from TCP. If the engine exits, the wait ends at
once with its exit code and last log lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, StepFailed, log
from vllm_redeploy.endpoint import api_base, engine_version, list_models
from vllm_redeploy.names import artifact_key
from vllm_redeploy.nodes import RemoteError, fan_out
from vllm_redeploy.parsers.vllm_log import LoadProgress, last_load_progress
from vllm_redeploy.plan import engine_container, ray_container
from vllm_redeploy.safe_text import block, shown
from vllm_redeploy.summary import StepEvent, report

STEP = "wait-ready"
POLL_S = 0.25  # readiness is noticed within this, plus one request
PROGRESS_EVERY_S = 5.0
LOG_TAIL_LINES = 30
GROUP_CHECK_S = 2.0  # how often the Ray containers of every node are looked at
HTTP_TIMEOUT = httpx.Timeout(2.0, connect=1.0)


@dataclass(frozen=True)
class Ready:
    served: list[str]
    waited_s: float
    version: str | None = None  # vLLM's, from /version or `vllm --version` in the engine


# Not cached: readiness is only true now, and the engine it watches is this run's.
@task(name="wait-ready", cache_policy=NO_CACHE)
def wait_until_ready(run: Run) -> Ready:
    config = run.config
    docker = run.head.docker
    name = engine_container(config)
    want = config.vllm.served_name
    url = api_base(config)
    deadline_s = config.deadlines.model_load_s
    started = time.monotonic()
    progress_id = create_progress_artifact(
        0.0,
        key=artifact_key(config.name, "load"),
        description=f"Loading {want} on {config.head.name}",
    )
    last_progress = 0.0
    last_load: LoadProgress | None = None
    last_report = started
    next_group_check = started + GROUP_CHECK_S
    listed: list[str] | None = None
    with httpx.Client(timeout=HTTP_TIMEOUT) as client:
        while True:
            listed, _ = list_models(client, url)
            if listed is not None and want in listed:
                update_progress_artifact(progress_id, 100.0)
                waited = time.monotonic() - started
                shards = last_load.total if last_load else 0
                report(StepEvent(STEP, "loading", load=LoadProgress(100, shards, shards)))
                log().info("%s is served at %s after %.1f s", want, url, waited)
                version = engine_version(client, url, docker.exec_runner(name))
                return Ready(listed, waited, version)
            info = docker.get(name)
            if info is None or not info.running:
                tail = docker.logs_tail(name, LOG_TAIL_LINES).strip() if info else ""
                oom = " (killed: out of memory)" if info and info.oom_killed else ""
                if info and info.exit_code == 137 and not oom:
                    oom = " (killed by SIGKILL: usually the kernel's out-of-memory killer)"
                code = info.exit_code if info else "gone"
                stopped = _stopped_ray(run)
                raise StepFailed(
                    STEP,
                    (f"{stopped[0]}; then " if stopped else "")
                    + f"the vLLM engine on {config.head.name} exited with code {code}{oom} "
                    f"after {time.monotonic() - started:.1f} s. Last log lines:\n{block(tail)}",
                )
            now = time.monotonic()
            if now >= next_group_check:
                next_group_check = now + GROUP_CHECK_S
                stopped = _stopped_ray(run)
                if stopped:
                    raise StepFailed(
                        STEP,
                        f"{stopped[0]}, {now - started:.1f} s into the load; the model cannot "
                        "be served without every node. Check that node (its Docker engine may "
                        "have restarted, or the node rebooted); the next run starts the whole "
                        f"group again. Last Ray log lines there:\n{block(stopped[1])}",
                    )
            if now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                progress = last_load_progress(docker.logs_tail(name, 20))
                if progress and progress.percent != last_progress:
                    last_progress = progress.percent
                    last_load = progress
                    update_progress_artifact(progress_id, float(progress.percent))
                    report(StepEvent(STEP, "loading", load=progress))
                    log().info(
                        "loading weights: %d%% (%d/%d shards)",
                        progress.percent,
                        progress.done,
                        progress.total,
                    )
            if now - started >= deadline_s:
                tail = docker.logs_tail(name, LOG_TAIL_LINES).strip()
                stale = (
                    f"; the server lists {', '.join(map(shown, listed))} instead" if listed else ""
                )
                raise StepFailed(
                    STEP,
                    f"{want} was not served at {url} within {deadline_s:g} s{stale}. "
                    f"Last log lines:\n{block(tail)}",
                )
            time.sleep(POLL_S)


def _stopped_ray(run: Run) -> tuple[str, str] | None:
    """The first node whose Ray container no longer runs: what happened, in words, and its last
    log lines. A node that cannot be inspected now is skipped (the engine's exit will tell)."""
    name = ray_container(run.config)
    outcomes = fan_out(run.config.nodes, lambda n: run.node(n.name).docker.get(name))
    for outcome in outcomes:
        info = outcome.value
        if outcome.error is not None or (info is not None and info.running):
            continue
        if info is None:
            return f"the Ray container on {outcome.node} is gone", "(none: it was removed)"
        try:
            tail = run.node(outcome.node).docker.logs_tail(name, LOG_TAIL_LINES // 3).strip()
        except RemoteError as exc:
            tail = f"(unreadable: {exc})"
        return f"the Ray container on {outcome.node} exited with code {info.exit_code}", tail
    return None
