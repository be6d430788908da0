"""Step "ports-free": once the old stack is stopped, nothing listens on the head's API and Ray
ports, at any address the group's bind would collide with (vLLM's 0.0.0.0 collides with an old
server on 127.0.0.1 or the LAN address). Not a preflight check: the stack being replaced
usually holds these very ports."""

from __future__ import annotations

import re
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.launch.plan import LaunchPlan
from vllm_redeploy.safe_text import one_line, shown

STEP = "ports-free"
RECHECK_S = 0.5


# Not cached: the answer is only true now.
@task(name="ports-free", cache_policy=NO_CACHE, **RETRY_TRANSIENT)
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
    config = run.config
    ports = dict(plan.ports)
    query = " or ".join(f"sport = :{port}" for port in ports)
    result = run.head.runner.run(["ss", "-Hltnp", f"( {query} )"], check=False)
    if not result.ok:  # never "free" when we could not look
        why = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise StepFailed(
            STEP,
            f"could not check the head's ports on {config.head.name}: `ss` exited with "
            f"code {result.exit_code} ({one_line(why[0])}); it comes with iproute2: install it "
            "on the node",
        )
    binds = {port: _bind_address(run, port) for port in ports}
    found = {
        port: [x for x in result.stdout.splitlines() if _listens(x, binds[port], port)]
        for port in ports
    }
    hidden = any(lines and not _owners(lines) for lines in found.values())
    if hidden and not run.head.root().is_root:
        # `ss -p` shows a user only its own processes: root's view, where sudo -n allows it.
        again = run.head.runner.run(["sudo", "-n", *result.argv], check=False)
        if again.ok:
            found = {
                port: [x for x in again.stdout.splitlines() if _listens(x, binds[port], port)]
                for port in ports
            }
    return [
        f"{label} {port} is in use by a process that is not ours{_owners(found[port])}"
        for port, label in ports.items()
        if found[port]
    ]


WILDCARD = ("0.0.0.0", "*", "::", "")  # noqa: S104 - comparing, not binding


def _bind_address(run: Run, port: int) -> str:
    """Where the group will listen on ``port``: the API at ``[vllm] host`` (vLLM's default,
    and ours, 0.0.0.0), the backend's ports (Ray's GCS, the rendezvous) on every address."""
    return run.config.vllm.host if port == run.config.vllm.port else "0.0.0.0"  # noqa: S104


def _listens(ss_line: str, bind: str, port: int) -> bool:
    """Would this `ss -Hltn` listener keep the group from binding ``bind``:``port``? A bind to
    every address fails on any listener of the port (127.0.0.1, the LAN address, ...); one to
    an address, on a listener there or on every address."""
    fields = ss_line.split()
    if len(fields) < 4:
        return False
    address, _, listen_port = fields[3].rpartition(":")
    address = address.strip("[]").split("%")[0]  # [::1], fe80::1%eth0
    if listen_port != str(port):
        return False
    return bind in WILDCARD or address in (bind, *WILDCARD)


def _owners(ss_lines: list[str]) -> str:
    """Who listens, where `ss -p` may show it (root sees every process): ', python3 (PID 7)'."""
    found = dict.fromkeys(
        f"{shown(name)} (PID {pid})"
        for line in ss_lines
        for name, pid in re.findall(r'\("([^"]*)",pid=(\d+)', line)
    )
    return f", {', '.join(found)}" if found else ""
