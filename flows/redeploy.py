"""Bring the vLLM cluster back: the operator's runbook as one flow.

0. Preflight: every node reachable (late ones waited for), Docker, image, model, Ray, ports.
1. Stop what auto-starts at boot (units, containers) and our own earlier containers.
2. Make sure every GPU is free.
3. Start the Ray head, pinned to the head's fabric IP.
4. Join the workers, each pinned to its own fabric IP.
5. Check that Ray sees every node and every GPU.
6. Launch `vllm serve` across the cluster.
7. Wait while the weights load, until /v1/models names our model (or the engine dies).
8. Probe: one chat completion, judged the way a reasoning model answers.

``ensure`` first checks the running deployment and changes nothing if it is whole and healthy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.futures import wait

from tasks.cluster_check import check_ray_cluster
from tasks.context import Run, StepFailed, log
from tasks.diagnostics import collect_diagnostics
from tasks.gpus_clear import wait_gpus_clear
from tasks.inspect_deployment import inspect_deployment
from tasks.join_workers import join_worker
from tasks.launch_vllm import launch_vllm
from tasks.preflight import judge_preflight, preflight_node
from tasks.probe import probe_model
from tasks.ray_head import start_ray_head
from tasks.stop_autostart import stop_autostart
from tasks.teardown import teardown_group
from tasks.wait_ready import wait_until_ready
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes import RemoteError

Mode = Literal["redeploy", "ensure"]


@dataclass
class Outcome:
    """What the run did, step by step; the flow's return value and the summary artifact."""

    cluster: str
    mode: str
    action: str = "redeployed"
    steps: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    probe: dict[str, Any] | None = None


class Steps:
    """Times each step and remembers which one is running, for the failure message."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.current = "start"

    def __call__(self, name: str, fn: Any, *args: Any) -> Any:
        self.current = name
        log().info("step %s", name)
        started = time.monotonic()
        result = fn(*args)
        self.outcome.steps[name] = round(time.monotonic() - started, 2)
        return result


def per_node(task: Any, run: Run, names: list[str]) -> list[Any]:
    """Run a per-node task on every named node in parallel; raise the first failure."""
    futures = [task.submit(run, name) for name in names]
    wait(futures)
    return [f.result() for f in futures]


@flow(name="redeploy-vllm-cluster", log_prints=True)
def redeploy_vllm_cluster(
    config_path: str = "cluster.toml",
    mode: Mode = "redeploy",
    keep_on_failure: bool = False,
) -> dict[str, Any]:
    """Bring the vLLM cluster described by ``config_path`` back (``ensure``: only if needed).

    Secrets come from the environment or .env of the process that runs the flow, never from
    parameters.
    """
    config = load_config(config_path)
    run = Run(config)
    outcome = Outcome(config.name, mode)
    step = Steps(outcome)
    nodes = [n.name for n in config.nodes]
    launched = False
    try:
        if mode == "ensure":
            health = step("inspect", inspect_deployment, run)
            if health.healthy:
                outcome.action = "already healthy: nothing changed"
                outcome.notes.append(health.reason)
                return _finish(run, outcome)
            outcome.notes.append(f"redeploying: {health.reason}")
        facts = step("preflight", per_node, preflight_node, run, nodes)
        judge_preflight(run, facts)
        stopped = step("stop-autostart", per_node, stop_autostart, run, nodes)
        outcome.notes += [s.summary() for s in stopped]
        gpus = step("gpus-clear", per_node, wait_gpus_clear, run, nodes)
        outcome.notes += [g.summary() for g in gpus]
        launched = True
        step("ray-head", start_ray_head, run, config.head.name)
        step("join-workers", per_node, join_worker, run, [w.name for w in config.workers])
        step("cluster-check", check_ray_cluster, run)
        step("launch-vllm", launch_vllm, run)
        ready = step("wait-ready", wait_until_ready, run)
        outcome.notes.append(f"model served after {ready.waited_s:.1f} s of loading")
        verdict = step("probe", probe_model, run)
        outcome.probe = verdict.as_dict()
        return _finish(run, outcome)
    except (StepFailed, RemoteError) as exc:
        failed_step = exc.step if isinstance(exc, StepFailed) else step.current
        reason = exc.reason if isinstance(exc, StepFailed) else str(exc)
        _fail(run, failed_step, reason, tear_down=launched and not keep_on_failure)
        raise
    finally:
        run.close()


def _finish(run: Run, outcome: Outcome) -> dict[str, Any]:
    lines = [f"# {outcome.cluster}: {outcome.action}", "", "| step | seconds |", "| --- | --- |"]
    lines += [f"| {name} | {seconds} |" for name, seconds in outcome.steps.items()]
    lines += ["", *(f"- {note}" for note in outcome.notes)]
    if outcome.probe:
        lines.append(f"- probe: {outcome.probe['detail']}")
    create_markdown_artifact(
        "\n".join(lines), key=f"{outcome.cluster}-summary", description="what the redeploy did"
    )
    emit_event(
        "vllm.cluster.ready",
        resource={"prefect.resource.id": f"vllm-redeploy.cluster.{outcome.cluster}"},
        payload={"mode": outcome.mode, "action": outcome.action, "steps": outcome.steps},
    )
    return {
        "cluster": outcome.cluster,
        "mode": outcome.mode,
        "action": outcome.action,
        "steps": outcome.steps,
        "notes": outcome.notes,
        "probe": outcome.probe,
    }


def _fail(run: Run, step: str, reason: str, tear_down: bool) -> None:
    log().error("failed at %s: %s", step, reason)
    try:
        collect_diagnostics(run, step, reason)
    except Exception as exc:
        log().warning("could not collect diagnostics: %s", exc)
    if tear_down:
        teardown_group(run)
    emit_event(
        "vllm.cluster.failed",
        resource={"prefect.resource.id": f"vllm-redeploy.cluster.{run.config.name}"},
        payload={"step": step, "reason": reason[:2000]},
    )


if __name__ == "__main__":
    redeploy_vllm_cluster()
