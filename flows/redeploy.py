"""Bring the vLLM cluster back: the operator's runbook as one flow.

First: change nothing when the cluster is paused or crash-looping (see tasks/guard.py); a
recovery waits its backoff. Then, for the whole run, hold the cluster, so no other run of it
(nightly, after-reboot, recover, manual) touches its nodes meanwhile. A pause taken while the
run waits or works is read again before every step that changes the nodes.
0. Preflight: every node reachable (late ones waited for), Docker, image, model, fabric IP and
   fabric (interfaces, RDMA HCAs). A node that lacks the source node's image or model files
   gets them (sync). Pick the launch backend from what the image holds. Then
   every node reaches every other over the fabric on a port vLLM's ranks would use (a firewall
   that opens only the named ports is named here, not as a silent hang at the start).
1. Stop what auto-starts at boot (units, containers) and our own earlier containers.
2. Make sure every GPU is free, the memory vLLM will ask for (page cache dropped on unified
   memory), the compile cache's directory (handed to the image's user when it is not root),
   and the head's ports.
3-6. Launch the group, one step per phase of the plan. Ray backend: start the Ray head, join
   the workers (each pinned to its fabric IP), check that Ray sees every node and GPU, launch
   `vllm serve` on the head. mp backend (vLLM's own launcher, no Ray): launch every rank at
   once, the followers and the leader.
7. Wait while the weights load, until /v1/models names our model (or a member dies).
8. Prove the transport: NCCL used RDMA between the nodes (else fail when it is required).
9. Probe: one chat completion, judged the way a reasoning model answers.

``ensure`` first checks the running deployment and changes nothing if it is whole and healthy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.futures import wait
from prefect.runtime import deployment
from prefect.states import Cancelled, Completed, State

from tasks.cache_dir import own_cache_dir
from tasks.context import Run, StepFailed, log
from tasks.diagnostics import collect_diagnostics
from tasks.fabric_reach import judge_reach, pick_port, reach_from
from tasks.gpus_clear import wait_gpus_clear
from tasks.guard import HandsOff, Trigger, guard_run, stand
from tasks.inspect_deployment import inspect_deployment
from tasks.launch import launch_phase
from tasks.memory import make_memory_free
from tasks.ports_free import wait_ports_free
from tasks.preflight import (
    NodeFacts,
    judge_preflight,
    launch_plan,
    preflight_node,
    preflight_problems,
    revision_notes,
)
from tasks.probe import probe_model
from tasks.records import FLUSH_S
from tasks.standing.lock import Hold, cluster_lock
from tasks.standing.marks import clear_crashloop
from tasks.standing.recoveries import SKIPPED, UNCHANGED
from tasks.standing.runs import named_run, run_name, tag_this_run
from tasks.stop_autostart import stop_autostart
from tasks.stop_group import stop_group
from tasks.sync import sync_node
from tasks.teardown import teardown_group
from tasks.transport import half_bandwidth, prove_transport
from tasks.wait_ready import wait_until_ready
from vllm_redeploy.config import CONFIG_VARIABLE, ConfigError, load_config
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.events import failed_event, ready_event
from vllm_redeploy.launch.caches import cache_owner, compile_cache_words
from vllm_redeploy.launch.choose import BACKENDS, assumed, backend_problem, plan_for
from vllm_redeploy.masking import mask_logs, masked
from vllm_redeploy.names import artifact_key
from vllm_redeploy.nodes import RemoteError
from vllm_redeploy.safe_text import one_line, shown
from vllm_redeploy.summary import RunSummary, StepEvent, render_markdown, report
from vllm_redeploy.sync import NO_MODEL, Copied, Holdings, plan_sync

Mode = Literal["redeploy", "ensure", "stop"]


class Steps:
    """Times each step, remembers which one is running (for the failure message) and reports
    its progress to whoever listens in this process (``vllm_redeploy.summary.report``)."""

    def __init__(self, summary: RunSummary, stand: Callable[[], None]) -> None:
        self.summary = summary
        self.stand = stand  # raises HandsOff once the cluster is paused (tasks/guard.py)
        self.current = "start"
        self.changed = False  # a step that changes the nodes has begun
        self.launching = False  # the group's first container may be up: a failure removes it
        self.served = False  # the probe passed: nothing after it removes the group
        self.hold: Hold | None = None

    def __call__(self, name: str, fn: Any, *args: Any) -> Any:
        self._start(name)
        started = time.monotonic()
        try:
            result = fn(*args)
        finally:
            self.summary.steps[name] = round(time.monotonic() - started, 2)
        report(StepEvent(name, "done", self.summary.steps[name]))
        return result

    def change(self, name: str, fn: Any, *args: Any) -> Any:
        """A step that changes the nodes: it starts only while this run still holds the
        cluster (another may have taken it while the Prefect server was away) and nobody has
        paused it since."""
        if self.hold is not None:
            self.hold.confirm()
        try:
            self.stand()
        except HandsOff as exc:
            raise HandsOff(exc.reason, before=name) from None
        self.changed = True
        return self(name, fn, *args)

    @contextmanager
    def holding(self, name: str, hold: AbstractContextManager[Hold]) -> Iterator[Hold]:
        """The cluster's lock, held for the rest of the run: timed until it is taken."""
        self._start(name)
        started = time.monotonic()
        try:
            with hold as self.hold:
                self.summary.steps[name] = round(time.monotonic() - started, 2)
                report(StepEvent(name, "done", self.summary.steps[name]))
                yield self.hold
        finally:
            self.hold = None  # released: what fails later is not this run's to tear down

    def _start(self, name: str) -> None:
        self.current = name
        log().info("step %s", name)
        report(StepEvent(name, "running"))


def per_node(task: Any, run: Run, names: list[str], *args: Any) -> list[Any]:
    """Run a per-node task on every named node in parallel; raise the first failure."""
    futures = [task.submit(run, name, *args) for name in names]
    wait(futures)
    return [f.result() for f in futures]


def _config_file(config_path: str | None) -> str | None:
    """The file this run reads: ``config_path`` (or the one VLLM_REDEPLOY_CONFIG names); for a
    run of a deployment only one of the files its serve or worker was started with, else
    StepFailed at config before anything else: from the UI, config_path is a free field."""
    served = [p for p in os.environ.get(CONFIG_VARIABLE, "").split(os.pathsep) if p]
    named = config_path or (served[0] if len(served) == 1 else None)
    if deployment.get_id() is None:
        return named
    same = [p for p in served if named and os.path.realpath(p) == os.path.realpath(named)]
    if same:
        return same[0]
    started = ", ".join(map(shown, served)) or f"none: {CONFIG_VARIABLE} is not set"
    reason = (
        f"deployment {shown(deployment.name)} refuses config_path {shown(named)}: its runs use "
        f"only the configuration their serve or worker was started with ({started}). Run "
        "another file with `vllm-redeploy run --config FILE`, or serve it; a worker names its "
        f"files in {CONFIG_VARIABLE}"
    )
    log().error("failed at config: %s", reason)
    raise StepFailed("config", reason)


@flow(name="redeploy-vllm-cluster", flow_run_name=run_name, log_prints=True)
def redeploy_vllm_cluster(
    config_path: str | None = None,
    mode: Mode = "redeploy",
    keep_on_failure: bool = False,
    trigger: Trigger = "manual",
    override_pause: bool = False,
) -> dict[str, Any] | State:
    """Bring the vLLM cluster described by ``config_path`` back (``ensure``: only if needed;
    ``stop``: remove the group on purpose, and prove it gone).

    ``trigger``: what started the run (manual, nightly, after-reboot, recover); nothing automatic
    touches a paused or crash-looping cluster, and a manual run only with ``override_pause``.
    Secrets come from the environment or .env of the process that runs the flow, never from
    parameters. A run of a deployment uses only a configuration its process was started with
    (``serve --config``, a worker's VLLM_REDEPLOY_CONFIG): a ``config_path`` that names another
    file fails at step config, before anything else, since the run would read that file's nodes
    with this process's secrets. Called directly (``vllm-redeploy run --config``), ``config_path``
    is the file to run (default: VLLM_REDEPLOY_CONFIG when it names one, else cluster.toml).
    """
    named = _config_file(config_path)
    try:
        config = load_config(named)
        if problem := backend_problem(config):  # the launch backends' registry, not config's
            raise ConfigError(str(named), [problem])
    except ConfigError as exc:
        reason = f"{shown(exc.source)} cannot be used: {'; '.join(exc.problems)}"
        log().error("failed at config: %s", reason)
        raise StepFailed("config", reason) from None
    run = Run(config)
    unmask = mask_logs(config.secret_values())
    run.records.record("tags", lambda: tag_this_run(config.name))  # what `pause` finds it by
    report(StepEvent("flow run", "named", detail=named_run()))
    summary = RunSummary(
        config.name,
        mode,
        node_ips={n.ip: n.name for n in config.nodes},
        endpoint=f"{api_base(config)}/v1",
        model=config.vllm.served_name,
        image=config.vllm.image,
    )
    step = Steps(summary, lambda: stand(run, trigger, override_pause))
    handled: BaseException | None = None
    stopped: HandsOff | None = None
    try:
        guard = step("guard", guard_run, run, trigger, override_pause)
        if guard.skip is not None:
            summary.action = f"skipped: {guard.skip}"
            data = _finish(run, summary, event=False)
            return Completed(name=SKIPPED, message=guard.skip, data=data)
        with step.holding("cluster-lock", cluster_lock(config)) as hold:
            run.hold_check = hold.confirm  # before every call that changes a node
            try:
                step.stand()  # paused while this run waited for the cluster or its backoff
                _runbook(run, mode, step)
            except HandsOff as exc:
                stopped = exc
            except BaseException as exc:  # a cancellation too: the same clean-up as a failure
                handled = exc  # reported while the cluster is still held: nobody else starts
                _fail(run, summary, *_explain(exc, step.current), keep_on_failure, step)
                raise
        if stopped is not None:
            return _hands_off(run, step, stopped)
        if trigger == "manual" and mode != "stop":
            _clear_crashloop(config.name)
        result = _finish(run, summary, event=mode != "stop")  # ready: only when it serves
        if summary.action.startswith("already healthy"):
            return Completed(name=UNCHANGED, message=summary.action, data=result)
        return result
    except BaseException as exc:  # every failure ends the same way: diagnostics, event, teardown
        failed_step, reason = _explain(exc, step.current)
        if exc is not handled:  # taking the cluster failed: nothing was started
            _fail(run, summary, failed_step, reason, keep_on_failure, step)
        if not isinstance(exc, Exception):
            raise
        hidden = masked(reason, config.secret_values())
        if hidden != reason:  # the state message and its traceback: nothing of the secret
            raise StepFailed(failed_step, hidden) from None
        if isinstance(exc, StepFailed | RemoteError):
            raise
        raise StepFailed(failed_step, reason) from exc
    finally:
        run.hold_check = None
        _flush(run)
        run.close()
        unmask()


def _hands_off(run: Run, step: Steps, stopped: HandsOff) -> State:
    """The end of a run whose cluster was paused after its guard: Skipped if it had changed
    nothing yet, else Cancelled before its next change, leaving the nodes as they are."""
    summary = step.summary
    if not step.changed:
        log().warning("changing nothing: %s", stopped.reason)
        summary.action = f"skipped: {stopped.reason}"
        data = _finish(run, summary, event=False)
        return Completed(name=SKIPPED, message=stopped.reason, data=data)
    said = f"stopped before {stopped.before}, leaving the nodes as they are: {stopped.reason}"
    log().warning("%s", said)
    summary.action = said
    _finish(run, summary, event=False)
    return Cancelled(message=said)


def _runbook(run: Run, mode: Mode, step: Steps) -> None:
    """The operator's steps, in order, into the run's summary; the flow holds the cluster around
    them."""
    config, summary = run.config, step.summary
    nodes = [n.name for n in config.nodes]
    if mode == "stop":
        _stop(run, step)
        return
    if mode == "ensure":
        health = step("inspect", inspect_deployment, run)
        if health.healthy:
            summary.action = "already healthy: nothing changed"
            summary.notes.append(health.reason)
            return
        summary.notes.append(f"redeploying: {health.reason}")
    facts = step("preflight", per_node, preflight_node, run, nodes)
    facts = _sync(run, step, facts)
    summary.image_id = next((f.image_id for f in facts if f.image_id), None)
    plan = launch_plan(run, facts)
    judge_preflight(run, facts, plan)
    summary.backend = plan.reason
    summary.loader, summary.load_format = plan.loader, plan.load_format
    summary.notes += [note for f in facts for note in f.notes] + revision_notes(facts)
    if len(nodes) > 1:
        port = pick_port()
        reports = step("fabric-reach", per_node, reach_from, run, nodes, port)
        summary.notes += judge_reach(run, plan, reports, port)
    summary.stopped = step.change("stop-autostart", per_node, stop_autostart, run, nodes)
    summary.gpus = step("gpus-clear", per_node, wait_gpus_clear, run, nodes)
    gpus = {g.node: g for g in summary.gpus}
    summary.memory = step.change("memory", per_node, make_memory_free, run, nodes, gpus)
    owner = cache_owner(config, next(f.image_user for f in facts if f.node == config.head.name))
    if owner is not None:
        step.change("cache-dir", per_node, own_cache_dir, run, nodes, owner)
    step("ports-free", wait_ports_free, run, plan)
    step.launching = True
    for index, phase in enumerate(plan.phases):
        summary.group = step.change(phase.step, launch_phase, run, plan, index) or summary.group
    ready = step("wait-ready", wait_until_ready, run, plan)
    summary.load_s, summary.vllm_version = ready.waited_s, ready.version
    summary.weights_s = ready.weights_s
    summary.compile_cache = compile_cache_words(config, ready.compile)
    if len(config.nodes) > 1:
        summary.transport = step("transport", prove_transport, run, plan)
        summary.notes += half_bandwidth(plan, summary.transport)
    summary.probe = step("probe", probe_model, run)
    step.served = True


def _stop(run: Run, step: Steps) -> None:
    """`vllm-redeploy stop`: the group removed on purpose, then proven gone: the GPUs clear and
    nothing listening on the head's ports of the backend it ran on."""
    config, summary = run.config, step.summary
    nodes = [n.name for n in config.nodes]
    removed = step.change("stop-group", per_node, stop_group, run, nodes)
    summary.gpus = step("gpus-clear", per_node, wait_gpus_clear, run, nodes)
    backend = next((b for r in removed for b in r.backends if b in BACKENDS), assumed(config))
    step("ports-free", wait_ports_free, run, plan_for(backend, config))
    gone = "; ".join(r.summary() for r in removed)
    summary.action = "stopped"
    summary.notes.append(f"{gone}; the GPUs are clear and the head's ports free")


def _sync(run: Run, step: Steps, facts: list[NodeFacts]) -> list[NodeFacts]:
    """Copy the source's image and model to the nodes that lack them (``[sync]``); those nodes'
    preflight is asked again, so that what is judged next is what they hold now."""
    config, summary = run.config, step.summary
    plan = plan_sync(config, [Holdings(f.node, f.image_id, f.model or NO_MODEL) for f in facts])
    if not plan.needs:
        return facts
    problems = preflight_problems(run, facts, {need.target for need in plan.needs})
    if problems:  # nothing is copied to a cluster that would fail for another reason
        raise StepFailed("preflight", "; ".join(problems))
    summary.notes += list(plan.problems)
    image_id = next(f.image_id for f in facts if f.node == plan.source)

    def copy_all() -> list[Copied]:
        futures = [sync_node.submit(run, need.target, need, image_id) for need in plan.needs]
        wait(futures)
        return [copied for f in futures for copied in f.result()]

    summary.synced = step.change("sync", copy_all)
    summary.notes += [
        f"{need.target}: held revision {need.revisions[0] or 'none'} of the model, now the "
        f"source's {need.revisions[1]} (only the blobs it lacked were copied)"
        for need in plan.needs
        if need.revisions
    ]
    summary.notes += [
        f"{need.target}: its earlier build of {config.vllm.image} ({need.old_image_id[:19]}) "
        "stays on the node, untagged (`docker image rm` it when no longer needed)"
        for need in plan.needs
        if need.old_image_id
    ]
    asked = {need.target for need in plan.needs}
    again = per_node(preflight_node.with_options(refresh_cache=True), run, sorted(asked))
    fresh = {f.node: f for f in again}
    return [fresh.get(f.node, f) for f in facts]


def _explain(exc: BaseException, current: str) -> tuple[str, str]:
    """The failed step and a one-paragraph reason; an exception nobody planned for is named as
    such, its traceback left to the flow run's log."""
    if isinstance(exc, StepFailed):
        return exc.step, exc.reason
    if isinstance(exc, RemoteError):
        return current, str(exc)
    if not isinstance(exc, Exception):
        said = f": {one_line(exc)}" if str(exc) else ""
        return current, (
            f"the run was stopped from outside during {current} ({type(exc).__name__}{said}): "
            "Prefect cancelled it, or its process was told to stop"
        )
    return current, (
        f"unexpected error in {current}: {type(exc).__name__}: {one_line(exc)} (a bug in "
        "vllm-redeploy or in what it talks to; the traceback is in the flow run's log)"
    )


def _finish(run: Run, summary: RunSummary, event: bool = True) -> dict[str, Any]:
    """The run's result, its summary artifact and its event: recorded when the Prefect API takes
    them (tasks/records.py), never a reason to fail a run that did its work."""
    markdown = _record_summary(run, summary, "what the redeploy did")
    if event:
        transport = summary.transport.as_dict() if summary.transport else None
        probe_s = summary.probe.elapsed_s if summary.probe else None
        weights = None
        if summary.load_format and summary.weights_s is not None:
            weights = (summary.load_format, summary.weights_s)
        ready = ready_event(
            summary.cluster,
            summary.mode,
            summary.action,
            summary.steps,
            transport,
            probe_s,
            weights,
        )
        run.records.record("event", lambda: emit_event(**ready))
    return {
        "cluster": summary.cluster,
        "mode": summary.mode,
        "action": summary.action,
        "steps": summary.steps,
        "notes": summary.notes,
        "probe": summary.probe.as_dict() if summary.probe else None,
        "compile_cache": summary.compile_cache,
        "summary": markdown,
    }


def _record_summary(run: Run, summary: RunSummary, description: str) -> str:
    """The summary's markdown, recorded as the run's summary artifact."""
    markdown = masked(render_markdown(summary), run.config.secret_values())
    key = artifact_key(summary.cluster, "summary")
    run.records.record(
        "summary", lambda: create_markdown_artifact(markdown, key=key, description=description)
    )
    return markdown


def _clear_crashloop(cluster: str) -> None:
    """A manual run that succeeded lifts the crash-loop mark; the API away leaves it set."""
    try:
        if clear_crashloop(cluster):
            log().info("a manual run succeeded: the crash-loop mark is cleared")
    except Exception as exc:
        log().warning(
            "could not clear the crash-loop mark (%s): `vllm-redeploy resume` clears it",
            one_line(exc),
        )


def _flush(run: Run) -> None:
    """Wait for the Prefect API to take what the run could not record yet (the summary among
    it), for a while; say what it never took."""
    if left := run.records.flush():
        log().warning(
            "the Prefect API did not take this run's %s within %.0f s: not recorded (the "
            "run's result and its log say what it did)",
            ", ".join(left),
            FLUSH_S,
        )


def _still_held(steps: Steps, summary: RunSummary) -> bool:
    """Only the holder removes a half-started group: one that lost the cluster leaves it."""
    try:
        if steps.hold is not None:
            steps.hold.confirm()
    except StepFailed as exc:
        summary.notes.append(f"did not remove the half-started group: {exc.reason}")
        return False
    return True


def _fail(
    run: Run, summary: RunSummary, step: str, reason: str, keep_on_failure: bool, steps: Steps
) -> None:
    """Report a failure everywhere it is looked for, and remove what this run started (unless
    kept to debug it); each part is tried even if another fails."""
    reason = masked(reason, run.config.secret_values())
    log().error("failed at %s: %s", step, reason)
    if reason.startswith("unexpected error"):
        log().error("the unexpected error's traceback", exc_info=True)
    tear_down = steps.launching and not steps.served and not keep_on_failure
    report(StepEvent(step, "failed", summary.steps.get(step), reason))
    summary.action, summary.failed_step, summary.failure = f"failed at {step}", step, reason
    try:
        collect_diagnostics(run, step, reason)
    except Exception as exc:
        log().warning("could not collect diagnostics: %s", one_line(exc))
    # Confirmed after the diagnostics, right before the removal: they can take a while.
    if tear_down and steps.hold is not None and _still_held(steps, summary):
        try:
            removed = teardown_group(run)
        except Exception as exc:
            summary.notes.append(f"could not remove the half-started group: {one_line(exc)}")
        else:
            gone = ", ".join(f"{n}: {', '.join(names)}" for n, names in removed.items() if names)
            summary.notes.append(f"removed the half-started group ({gone or 'nothing left'})")
    _record_summary(run, summary, "what the redeploy did before it failed")
    failed = failed_event(run.config.name, step, one_line(reason))
    run.records.record("event", lambda: emit_event(**failed))


if __name__ == "__main__":
    redeploy_vllm_cluster()
