"""Step "wait-ready": until /v1/models names our served model, while watching every member of
the group.

The API port refuses connections for the whole load, so "loading or dead" is judged from the
containers (alive, log moving), never from TCP. If any member exits (the engine or leader, a Ray
container, an mp follower), the wait ends at once with its node, exit code and last log lines.
On the mp backend it also watches the rendezvous: once the leader listens on the master port,
every follower must hold a connection to it within ``[deadlines] rendezvous_s``; one that does not
(wrong fabric IP, a firewall, another interface) is named with both ranks' last log lines, long
before vLLM's own 600 s rendezvous timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, StepFailed, log
from tasks.records import Progress
from vllm_redeploy.endpoint import (
    api_base,
    api_key,
    auth_headers,
    engine_version,
    list_models,
    refused_key,
)
from vllm_redeploy.launch.plan import LaunchPlan, Member
from vllm_redeploy.launch.rendezvous import follower_joined
from vllm_redeploy.names import artifact_key
from vllm_redeploy.nodes import NodeDocker, RemoteError, fan_out
from vllm_redeploy.parsers.vllm_log import (
    CompileCache,
    LoadProgress,
    compile_cache_state,
    last_load_progress,
    tail_for_people,
    weights_load_s,
)
from vllm_redeploy.safe_text import block, shown
from vllm_redeploy.summary import StepEvent, report

STEP = "wait-ready"
POLL_S = 0.25  # readiness is noticed within this, plus one request
PROGRESS_EVERY_S = 5.0
LOG_TAIL_LINES = 30
RAW_TAIL_LINES = 400  # read this much of a log to show LOG_TAIL_LINES of it without NCCL's INFO
GROUP_CHECK_S = 2.0  # how often the other members' containers are looked at
HTTP_TIMEOUT = httpx.Timeout(2.0, connect=1.0)
# The engine killed by SIGKILL, and what NCCL says when the container may not pin memory.
HINTS = {
    "ibv_reg_mr": "NCCL could not register memory with the RDMA device: the container needs "
    "IPC_LOCK and an unlimited memlock ([fabric] memlock_bytes = -1)",
    "(configured by VLLM_ENGINE_READY_TIMEOUT_S)": "vLLM gave up waiting for its engine to "
    "start: [vllm.env] VLLM_ENGINE_READY_TIMEOUT_S is shorter than the load; raise it, or leave "
    "it out so that it follows [deadlines] model_load_s",
    "no socket interface found": "NCCL found no interface named in NCCL_SOCKET_IFNAME on that "
    "node: fix the node's fabric_interfaces (or leave them out to use the discovered ones)",
}


@dataclass(frozen=True)
class Ready:
    served: list[str]
    waited_s: float
    version: str | None = None  # vLLM's, from /version or `vllm --version` in the engine
    compile: CompileCache | None = None  # warm or cold, as the engine's log says
    weights_s: float | None = None  # vLLM's own "Loading weights took N seconds"


# Not cached: readiness is only true now, and the engine it watches is this run's.
@task(name="wait-ready", task_run_name="wait-ready", cache_policy=NO_CACHE)
def wait_until_ready(run: Run, plan: LaunchPlan) -> Ready:
    config = run.config
    api = plan.api
    docker = run.node(api.node).docker
    name = api.spec.name
    want = config.vllm.served_name
    url = api_base(config)
    deadline_s = config.deadlines.model_load_s
    started = time.monotonic()
    progress = Progress(
        run.records, artifact_key(config.name, "load"), f"Loading {want} on {api.node}"
    )
    progress.set(0.0)
    rendezvous = Rendezvous(plan) if plan.rendezvous_port is not None else None
    last_progress = 0.0
    last_load: LoadProgress | None = None
    last_report = started
    next_group_check = started + GROUP_CHECK_S
    listed: list[str] | None = None
    with httpx.Client(timeout=HTTP_TIMEOUT, headers=auth_headers(api_key(config))) as client:
        while True:
            listed, why = list_models(client, url)
            if refused_key(why):  # it serves, and will refuse us for as long as it runs
                raise StepFailed(
                    STEP,
                    f"{api.what} on {api.node} answers {url}/v1/models with {why}. "
                    "Nothing we send will change that; the run stops instead of waiting "
                    f"{deadline_s:g} s.",
                )
            if listed is not None and want in listed:
                progress.set(100.0)
                waited = time.monotonic() - started
                done = _finished(last_load)
                report(StepEvent(STEP, "loading", load=done))
                log().info("%s is served at %s after %.1f s", want, url, waited)
                version = engine_version(client, url, docker.exec_runner(name))
                head = docker.log_head(name)
                return Ready(
                    listed, waited, version, compile_cache_state(head), weights_load_s(head)
                )
            if listed:  # vLLM answers only once loaded, and its served names are fixed for life
                raise StepFailed(
                    STEP,
                    f"{want} is not served at {url}: the server lists "
                    f"{', '.join(map(shown, listed))} instead, and will for as long as it runs, "
                    f"so the run stops now rather than waiting {deadline_s:g} s. Check [vllm] "
                    "served_model_name (what clients ask for) and which server answers on that "
                    f"port. Last log lines:\n{block(_tail(docker, name, LOG_TAIL_LINES))}",
                )
            info = docker.get(name)
            if info is None or not info.running:
                stopped = _stopped(run, plan, exclude=api)
                # "and", not "then": which went first is not known (the nodes' clocks are not
                # ours to compare). vLLM's followers outlive their leader: the failure's
                # teardown removes them.
                raise StepFailed(
                    STEP,
                    (f"{stopped[0]}, and " if stopped else "")
                    + _exited(run, api, info, time.monotonic() - started),
                )
            now = time.monotonic()
            if now >= next_group_check:
                next_group_check = now + GROUP_CHECK_S
                stopped = _stopped(run, plan, exclude=api)
                info = docker.get(name) if stopped else info
                if stopped and (info is None or not info.running):  # the API's member went too
                    raise StepFailed(
                        STEP,
                        f"{stopped[0]}, and " + _exited(run, api, info, now - started),
                    )
                if stopped:
                    raise StepFailed(
                        STEP,
                        f"{stopped[0]}, {now - started:.1f} s into the load; the model cannot be "
                        "served without every node. Check that node (its Docker engine may have "
                        "restarted, or the node rebooted); the next run starts the whole group "
                        f"again. Last log lines there:\n{block(stopped[1])}",
                    )
                if rendezvous is not None:
                    rendezvous.check(run, now)
            if now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                load = last_load_progress(docker.logs_tail(name, RAW_TAIL_LINES))
                if load and load.percent != last_progress:
                    last_progress = load.percent
                    last_load = load
                    progress.set(float(load.percent))
                    report(StepEvent(STEP, "loading", load=load))
                    log().info("loading weights: %d%% (%s)", load.percent, load.words())
            if now - started >= deadline_s:
                tail = _tail(docker, name, LOG_TAIL_LINES)
                missing = rendezvous.missing_text() if rendezvous else ""
                raise StepFailed(
                    STEP,
                    f"{want} was not served at {url} within {deadline_s:g} s{missing}. "
                    f"Last log lines:\n{block(tail)}",
                )
            time.sleep(POLL_S)


def _finished(last: LoadProgress | None) -> LoadProgress:
    """The bar at its end: the last one seen, at 100 %."""
    if last is None:
        return LoadProgress(100, 0, 0)
    total = last.amount.partition("/")[2]
    return replace(last, percent=100, done=last.total, amount=total and f"{total}/{total}")


def _exited(run: Run, member: Member, info: object, after_s: float) -> str:
    """`the vLLM engine on N exited with code C (why) after S s. Last log lines: ...`"""
    docker = run.node(member.node).docker
    what = member.what
    if info is None:
        return f"{what} on {member.node} is gone, {after_s:.1f} s into the load"
    code = getattr(info, "exit_code", None)
    why = ""
    if getattr(info, "oom_killed", False):
        why = " (killed: out of memory)"
    elif code == 137:
        why = " (killed by SIGKILL: usually the kernel's out-of-memory killer)"
    tail = _tail(docker, member.spec.name, LOG_TAIL_LINES)
    hint = next((f" {h}." for text, h in HINTS.items() if text in tail), "")
    return (
        f"{what} on {member.node} exited with code {code}{why} after {after_s:.1f} s.{hint} "
        f"Last log lines:\n{block(tail)}"
    )


def _stopped(run: Run, plan: LaunchPlan, exclude: Member) -> tuple[str, str] | None:
    """The first other member that no longer runs: what happened, in words, and its last log
    lines. A node that cannot be inspected now is skipped (the engine's own exit will tell)."""
    others = [m for m in plan.members if m is not exclude]
    outcomes = fan_out(
        [run.node_config(m.node) for m in others],
        lambda n: run.node(n.name).docker.get(_on(others, n.name).spec.name),
    )
    for member, outcome in zip(others, outcomes, strict=True):
        info = outcome.value
        if outcome.error is not None or (info is not None and info.running):
            continue
        if info is None:
            return f"{member.what} on {member.node} is gone", "(none: it was removed)"
        try:
            tail = _tail(run.node(member.node).docker, member.spec.name, LOG_TAIL_LINES // 3)
        except RemoteError as exc:
            tail = f"(unreadable: {exc})"
        return f"{member.what} on {member.node} exited with code {info.exit_code}", tail.strip()
    return None


def _on(members: list[Member], node: str) -> Member:
    return next(m for m in members if m.node == node)


@dataclass
class Rendezvous:
    """A group that meets at a rendezvous (mp): which members have joined the API member's
    rendezvous port, asked inside each one's container (vllm_redeploy.launch.rendezvous: the
    connection seen from its side)."""

    plan: LaunchPlan
    listening_since: float | None = None
    joined: set[str] = field(default_factory=set)
    done: bool = False

    def check(self, run: Run, now: float) -> None:
        if self.done:
            return
        config = run.config
        port = self.plan.rendezvous_port
        head = run.node(self.plan.api.node).runner
        if self.listening_since is None:
            listens = head.run(["ss", "-Hltn", f"( sport = :{port} )"], check=False)
            if listens.ok and listens.stdout.strip():
                self.listening_since = now
            return
        followers = [m for m in self.plan.members if not m.serves_api]
        waiting = [m for m in followers if m.node not in self.joined]
        answers = fan_out(
            [run.node_config(m.node) for m in waiting],
            lambda n: follower_joined(
                run.node(n.name).docker.exec_runner(_on(waiting, n.name).spec.name), port
            ),
        )
        self.joined |= {m.node for m, a in zip(waiting, answers, strict=True) if a.value}
        missing = [m for m in followers if m.node not in self.joined]
        if not missing:
            self.done = True
            log().info("every follower joined the rendezvous on port %d", port)
            return
        if now - self.listening_since < config.deadlines.rendezvous_s:
            return
        first = missing[0]
        leader = self.plan.api
        theirs = _tail(run.node(first.node).docker, first.spec.name, LOG_TAIL_LINES // 2)
        ours = _tail(run.node(leader.node).docker, leader.spec.name, LOG_TAIL_LINES // 2)
        raise StepFailed(
            STEP,
            f"{', '.join(m.node for m in missing)} never joined the rendezvous at "
            f"{config.head.ip}:{port}: the leader on {leader.node} has listened for "
            f"{now - self.listening_since:.0f} s ([deadlines] rendezvous_s) and the follower on "
            f"{first.node} holds no connection to it. Check that {first.node} reaches "
            f"{config.head.ip} on port {port} (its fabric IP and interface, a firewall). "
            f"Last log lines on {first.node}:\n{block(theirs.strip())}\n"
            f"Last log lines of the leader on {leader.node}:\n{block(ours.strip())}",
        )

    def missing_text(self) -> str:
        followers = [m.node for m in self.plan.members if not m.serves_api]
        missing = [n for n in followers if n not in self.joined]
        return f"; never joined the rendezvous: {', '.join(missing)}" if missing else ""


def _tail(docker: NodeDocker, name: str, lines: int) -> str:
    """A container's last ``lines`` log lines for people: NCCL's INFO lines left out."""
    return tail_for_people(docker.logs_tail(name, RAW_TAIL_LINES), lines).strip()
