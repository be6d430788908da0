"""Bring the vLLM cluster back: the operator's runbook as one flow.

0. Preflight: every node reachable (late ones waited for), Docker, image, model, Ray, fabric IP.
1. Stop what auto-starts at boot (units, containers) and our own earlier containers.
2. Make sure every GPU is free, and the head's API and Ray ports.
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
from tasks.launch_vllm import launch_vllm
from tasks.ports_free import wait_ports_free
from tasks.preflight import judge_preflight, preflight_node
from tasks.probe import probe_model
from tasks.ray_start import join_worker, start_ray_head
from tasks.stop_autostart import stop_autostart
from tasks.teardown import teardown_group
from tasks.wait_ready import wait_until_ready
from vllm_redeploy.config import ConfigError, load_config
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.nodes import RemoteError
from vllm_redeploy.safe_text import shown
from vllm_redeploy.summary import RunSummary, StepEvent, render_markdown, report

Mode = Literal["redeploy", "ensure"]


class Steps:
    """Times each step, remembers which one is running (for the failure message) and reports
    its progress to whoever listens in this process (``vllm_redeploy.summary.report``)."""

    def __init__(self, summary: RunSummary) -> None:
        self.summary = summary
        self.current = "start"

    def __call__(self, name: str, fn: Any, *args: Any) -> Any:
        self.current = name
        log().info("step %s", name)
        report(StepEvent(name, "running"))
        started = time.monotonic()
        try:
            result = fn(*args)
        finally:
            self.summary.steps[name] = round(time.monotonic() - started, 2)
        report(StepEvent(name, "done", self.summary.steps[name]))
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
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        reason = f"{shown(exc.source)} cannot be used: {'; '.join(exc.problems)}"
        log().error("failed at config: %s", reason)
        raise StepFailed("config", reason) from None
    run = Run(config)
    summary = RunSummary(
        config.name,
        mode,
        node_ips={n.ip: n.name for n in config.nodes},
        endpoint=f"{api_base(config)}/v1",
        model=config.vllm.served_name,
        image=config.vllm.image,
    )
    step = Steps(summary)
    nodes = [n.name for n in config.nodes]
    launched = False
    try:
        if mode == "ensure":
            health = step("inspect", inspect_deployment, run)
            if health.healthy:
                summary.action = "already healthy: nothing changed"
                summary.notes.append(health.reason)
                return _finish(summary)
            summary.notes.append(f"redeploying: {health.reason}")
        facts = step("preflight", per_node, preflight_node, run, nodes)
        summary.image_id = next((f.image_id for f in facts if f.image_id), None)
        judge_preflight(run, facts)
        summary.stopped = step("stop-autostart", per_node, stop_autostart, run, nodes)
        summary.gpus = step("gpus-clear", per_node, wait_gpus_clear, run, nodes)
        step("ports-free", wait_ports_free, run)
        launched = True
        step("ray-head", start_ray_head, run, config.head.name)
        step("join-workers", per_node, join_worker, run, [w.name for w in config.workers])
        summary.members = step("cluster-check", check_ray_cluster, run)
        step("launch-vllm", launch_vllm, run)
        ready = step("wait-ready", wait_until_ready, run)
        summary.load_s, summary.vllm_version = ready.waited_s, ready.version
        summary.probe = step("probe", probe_model, run)
        return _finish(summary)
    except (StepFailed, RemoteError) as exc:
        failed_step = exc.step if isinstance(exc, StepFailed) else step.current
        reason = exc.reason if isinstance(exc, StepFailed) else str(exc)
        _fail(run, summary, failed_step, reason, tear_down=launched and not keep_on_failure)
        raise
    finally:
        run.close()


def _finish(summary: RunSummary) -> dict[str, Any]:
    markdown = render_markdown(summary)
    create_markdown_artifact(
        markdown, key=f"{summary.cluster}-summary", description="what the redeploy did"
    )
    emit_event(
        "vllm.cluster.ready",
        resource={"prefect.resource.id": f"vllm-redeploy.cluster.{summary.cluster}"},
        payload={"mode": summary.mode, "action": summary.action, "steps": summary.steps},
    )
    return {
        "cluster": summary.cluster,
        "mode": summary.mode,
        "action": summary.action,
        "steps": summary.steps,
        "notes": summary.notes,
        "probe": summary.probe.as_dict() if summary.probe else None,
        "summary": markdown,
    }


def _fail(run: Run, summary: RunSummary, step: str, reason: str, tear_down: bool) -> None:
    log().error("failed at %s: %s", step, reason)
    report(StepEvent(step, "failed", summary.steps.get(step), reason))
    summary.action, summary.failed_step, summary.failure = f"failed at {step}", step, reason
    try:
        collect_diagnostics(run, step, reason)
    except Exception as exc:
        log().warning("could not collect diagnostics: %s", exc)
    if tear_down:
        removed = teardown_group(run)
        gone = ", ".join(f"{node}: {', '.join(names)}" for node, names in removed.items() if names)
        summary.notes.append(f"removed the half-started group ({gone or 'nothing left'})")
    try:
        create_markdown_artifact(
            render_markdown(summary),
            key=f"{summary.cluster}-summary",
            description="what the redeploy did before it failed",
        )
    except Exception as exc:  # the failure itself must still be reported and raised
        log().warning("could not write the summary: %s", exc)
    emit_event(
        "vllm.cluster.failed",
        resource={"prefect.resource.id": f"vllm-redeploy.cluster.{run.config.name}"},
        payload={"step": step, "reason": reason[:2000]},
    )


if __name__ == "__main__":
    redeploy_vllm_cluster()
