"""Step "stop-autostart": the listed units, the matching containers, and our own earlier ones.

Nothing else is touched: other containers stay, and no file is removed.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, log
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.nodes.containers import ContainerInfo, cluster_labels
from vllm_redeploy.safe_text import shown

ACTIVE_STATES = ("active", "activating", "reloading")


@dataclass(frozen=True)
class StopReport:
    node: str
    units_stopped: tuple[str, ...]
    units_disabled: tuple[str, ...]
    removed: tuple[str, ...]  # the previous stack's containers
    own_removed: tuple[str, ...]  # this project's earlier containers

    def summary(self) -> str:
        parts = [f"units stopped: {', '.join(self.units_stopped) or 'none'}"]
        if self.units_disabled:
            parts.append(f"disabled: {', '.join(self.units_disabled)}")
        parts.append(f"removed: {', '.join(map(shown, self.removed)) or 'none'}")
        if self.own_removed:
            parts.append(
                f"our earlier containers removed: {', '.join(map(shown, self.own_removed))}"
            )
        return f"{self.node}: " + "; ".join(parts)


# Not cached: it changes the node, and must run again on every run (the units come back at boot).
@task(
    name="stop-autostart",
    task_run_name="stop-autostart[{name}]",
    cache_policy=NO_CACHE,
    **RETRY_TRANSIENT,
)
def stop_autostart(run: Run, name: str) -> StopReport:
    """Stop (and optionally disable) the units, then remove the matching containers."""
    config = run.config
    access = run.node(name)
    stopped = _stop_units(run, name)
    disabled = _disable_units(run, name) if config.autostart.disable_units else []
    old, ours = access.docker.list_matching_and_labelled(
        config.autostart.containers, cluster_labels(config.name)
    )
    # A unit's stop can take minutes: what is listed now may be another holder's by then.
    run.before_change()
    _remove(run, name, {c.name: c for c in [*old, *ours]}.values())
    removed = [c.name for c in old]
    own = [c.name for c in ours if c.name not in removed]
    report = StopReport(name, tuple(stopped), tuple(disabled), tuple(removed), tuple(own))
    log().info(report.summary())
    return report


def stop_argv(unit: str) -> list[str]:
    return ["systemctl", "stop", unit]


def disable_argv(unit: str) -> list[str]:
    # --no-reload: `disable` reloads systemd itself, which under Docker's systemd cgroup driver
    # takes the GPUs from every running container on the node.
    return ["systemctl", "disable", "--no-reload", unit]


def root_commands(config: ClusterConfig) -> list[list[str]]:
    """What this step may run as root on a node: one command per unit, so that a sudoers line
    can allow exactly them (which units run changes from night to night)."""
    units = config.autostart.units
    disable = [disable_argv(u) for u in units] if config.autostart.disable_units else []
    return [*(stop_argv(u) for u in units), *disable]


def _stop_units(run: Run, name: str) -> list[str]:
    """Stop the configured units that run, side by side (a `systemctl stop` each, as root);
    which run, from one `systemctl is-active` (a line per unit, in order)."""
    units = run.config.autostart.units
    if not units:
        return []
    access = run.node(name)
    runner = access.runner
    states = runner.run(["systemctl", "is-active", *units], check=False).stdout.split()
    if len(states) != len(units):  # not one line per unit: ask for each
        states = [
            runner.run(["systemctl", "is-active", u], check=False).stdout.strip() for u in units
        ]
    running = [u for u, state in zip(units, states, strict=True) if state in ACTIVE_STATES]
    if running:
        run.before_change()
    root = access.root()
    with ThreadPoolExecutor(max_workers=max(len(running), 1)) as pool:
        list(pool.map(lambda u: runner.run(root.argv(stop_argv(u)), timeout=120), running))
    return running


def _disable_units(run: Run, name: str) -> list[str]:
    access = run.node(name)
    disabled = []
    for unit in run.config.autostart.units:
        enabled = access.runner.run(["systemctl", "is-enabled", unit], check=False)
        if enabled.stdout.strip() == "enabled":
            run.before_change()
            access.runner.run(access.root().argv(disable_argv(unit)), timeout=60)
            disabled.append(unit)
    return disabled


def _remove(run: Run, name: str, containers: Iterable[ContainerInfo]) -> None:
    containers = list(containers)
    docker = run.node(name).docker
    # Restart policies first, so nothing brings one back between our calls; then force-remove,
    # as the runbook does: they are being replaced, and a graceful stop costs up to 10 s each.
    for container in containers:
        if container.restart_policy != "no":
            docker.set_restart_policy(container.name, "no")
    docker.remove_all([c.name for c in containers])
