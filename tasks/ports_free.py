"""Step "ports-free": once the old stack is stopped, nothing listens on the head's API and
backend ports, at any address the group's bind would collide with (vLLM's 0.0.0.0 collides with
an old server on 127.0.0.1 or the LAN address). The stack being replaced usually holds these very
ports, so preflight refuses only a listener that the stop would leave (``held_ports``)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.launch.plan import LaunchPlan
from vllm_redeploy.listeners import (
    DOCKER_PROXY,
    Kept,
    Listener,
    Others,
    Owner,
    Stopping,
    cgroups_argv,
    collisions,
    kept_listeners,
    owners,
    parse_cgroups,
    parse_ss,
    ss_argv,
)
from vllm_redeploy.nodes.containers import cluster_labels
from vllm_redeploy.safe_text import one_line

STEP = "ports-free"
RECHECK_S = 0.5


# Not cached: the answer is only true now.
@task(name="ports-free", task_run_name="ports-free", cache_policy=NO_CACHE, **RETRY_TRANSIENT)
def wait_ports_free(run: Run, plan: LaunchPlan) -> None:
    """Wait (as long as GPUs get to be released) until the head's ports are free."""
    grace = run.config.deadlines.gpu_release_s
    deadline = time.monotonic() + grace
    while True:
        busy = busy_ports(run, plan)
        if not busy:
            return
        if time.monotonic() >= deadline:
            head = run.config.head.name
            raise StepFailed(
                STEP,
                "; ".join(f"{head}: the {b}" for b in busy)
                + f" (still, {grace:g} s after the autostart stack was stopped); stop it, add "
                "its container or unit to [autostart], or change the port in the configuration",
            )
        log().info("waiting for the head's ports: %s", "; ".join(busy))
        time.sleep(RECHECK_S)


def busy_ports(run: Run, plan: LaunchPlan) -> list[str]:
    """The head's ports of the plan (the API's, the backend's) that something listens on, with
    its owner where visible."""
    ports = dict(plan.ports)
    found = look(run, {port: bind_address(run, port) for port in ports}, STEP)
    return [
        f"{label} {port} is in use by a process that is not ours{owners(found[port])}"
        for port, label in ports.items()
        if found[port]
    ]


def look(run: Run, binds: Mapping[int, str], step: str) -> dict[int, list[Listener]]:
    """Per port of ``binds`` (port -> where the group binds it), the head's listeners in the
    way, with their processes where `ss -p` shows them (root sees every process: asked again
    through sudo -n where a login's own view hides one and sudo allows it)."""
    config = run.config
    runner = run.head.runner
    result = runner.run(ss_argv(binds), check=False)
    if not result.ok:  # never "free" when we could not look
        why = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise StepFailed(
            step,
            f"could not check the head's ports on {config.head.name}: `ss` exited with "
            f"code {result.exit_code} ({one_line(why[0])}); it comes with iproute2: install it "
            "on the node",
        )
    found = collisions(parse_ss(result.stdout), binds)
    hidden = any(not x.processes for listeners in found.values() for x in listeners)
    if hidden and not run.head.root().is_root:
        again = runner.run(["sudo", "-n", *result.argv], check=False)
        if again.ok:
            found = collisions(parse_ss(again.stdout), binds)
    return found


def bind_address(run: Run, port: int) -> str:
    """Where the group will listen on ``port``: the API at ``[vllm] host`` (vLLM's default,
    and ours, 0.0.0.0), the backend's ports (Ray's GCS, the rendezvous) on every address."""
    return run.config.vllm.host if port == run.config.vllm.port else "0.0.0.0"  # noqa: S104


def held_ports(run: Run) -> tuple[Kept, ...]:
    """Preflight's reading, before anything stops: the listeners on the head's possible ports
    (the API's, Ray's, the rendezvous') that stop-autostart would leave running, where the
    group must bind. ``judge_preflight`` judges those of the plan's ports."""
    config = run.config
    ports = (config.vllm.port, config.ray.port, config.vllm.master_port)
    found = look(run, {port: bind_address(run, port) for port in ports}, "preflight")
    pids = {pid for listeners in found.values() for x in listeners for _, pid in x.processes}
    if not pids:
        return ()
    head = run.head
    read = head.runner.run(cgroups_argv(pids), check=False)
    owners = {pid: Owner.of(paths) for pid, paths in parse_cgroups(read.stdout).items()}
    old, ours = head.docker.list_matching_and_labelled(
        config.autostart.containers, cluster_labels(config.name)
    )
    stopping = Stopping({c.id: c.name for c in (*old, *ours)}, frozenset(config.autostart.units))
    others = {o.container_id for o in owners.values() if o.container_id} - set(stopping.containers)
    names = {i: info.name for i in others if (info := head.docker.get(i)) is not None}
    proxied = {x.port for ls in found.values() for x in ls if DOCKER_PROXY in dict(x.processes)}
    published = {port: head.docker.publishing(port) for port in proxied}
    return tuple(kept_listeners(found, owners, stopping, Others(names, published)))
