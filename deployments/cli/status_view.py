"""`vllm-redeploy status`: the deployment now, as a table in a terminal and plain text when
piped.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from deployments.cli.common import (
    CONFIGS_DEFAULT,
    EVERYDAY,
    EXIT_FAILED,
    ConfigsOption,
    JsonOption,
    app,
    load_all_or_exit,
    markup_safe,
    out,
)
from deployments.cli.prefect_api import Found, api_key, find_api, talking_to
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.controller_api import ControllerApi, problem_with
from vllm_redeploy.launch.backend import GroupMember
from vllm_redeploy.safe_text import for_terminal, one_line
from vllm_redeploy.status import ClusterStatus, GpuStatus, NodeStatus, collect_status, duration

if TYPE_CHECKING:
    from tasks.standing.marks import WatcherBeat
    from tasks.standing.runs import PastRun


@app.command(rich_help_panel=EVERYDAY)
def status(config: ConfigsOption = CONFIGS_DEFAULT, as_json: JsonOption = False) -> None:
    """The deployment now: nodes, containers, GPUs, the group (Ray's members), endpoint, probe;
    one screen per cluster (repeat --config). Exit 0 iff every cluster is healthy."""
    clusters = load_all_or_exit(config)
    found = find_api(clusters, config)
    unknown = _unknown_standing(found)
    read_from = found.api if found.api is not None and unknown is None else None
    with (
        talking_to(read_from.environment() if read_from else {}),
        ThreadPoolExecutor(max_workers=2 * len(clusters)) as pool,
    ):
        standings = [pool.submit(_standing, c, unknown, read_from) for c in clusters]
        reports = list(pool.map(collect_status, clusters))
        held = [s.result() for s in standings]
    if as_json:
        api = {"url": read_from.url, "source": read_from.source} if read_from else None
        found_json = [
            {**r.as_dict(), "standing": h.headline, **h.as_dict(), "prefect_api": api}
            for r, h in zip(reports, held, strict=True)
        ]
        out.print_json(json.dumps(found_json))  # a list, one per cluster, however many
    else:
        for i, (report, standing) in enumerate(zip(reports, held, strict=True)):
            if i:
                out.rule(style="dim")
            print_status(report, standing, read_from=read_from)
    if not all(r.healthy for r in reports):
        raise typer.Exit(EXIT_FAILED)


def _unknown_standing(found: Found) -> str | None:
    """Why the standing cannot be read (no API found, or it does not answer), or None."""
    if found.api is None:
        return f"standing unknown: {found.problem} {found.fix()}."
    problem = problem_with(found.api, api_key())
    return f"standing unknown: {problem}" if problem else None


@dataclass(frozen=True)
class Standing:
    """What the controller's Prefect API says of a cluster: paused or crash-looping (or why
    that is unknown), its last run and its next scheduled one."""

    headline: str | None = None
    last: PastRun | None = None
    due: tuple[str, datetime] | None = None
    watcher: WatcherBeat | None = None
    read: bool = False  # the API answered: None above means "none", not "unknown"

    def as_dict(self) -> dict[str, Any]:
        return {
            "last_run": self.last.as_dict() if self.last else None,
            "next_run": (
                {"trigger": self.due[0], "due": self.due[1].isoformat()} if self.due else None
            ),
            "watcher": (
                {"alive": self.watcher.alive(), "age_s": round(self.watcher.age_s(), 1)}
                if self.watcher
                else None
            ),
        }


def _standing(config: ClusterConfig, unknown: str | None, api: ControllerApi | None) -> Standing:
    if unknown is not None or api is None:
        return Standing(unknown)
    from tasks.standing.marks import read_standing, watcher_beat
    from tasks.standing.runs import last_runs, next_run

    try:
        last = last_runs(config, 1)
        headline = read_standing(config.name).headline()
        beat = watcher_beat(config.name)
        return Standing(headline, last[0] if last else None, next_run(config), beat, True)
    except Exception as exc:  # status must work while Prefect is down
        return Standing(f"standing unknown: {api.described()} failed: {one_line(exc)[:200]}")


def print_status(
    report: ClusterStatus,
    standing: Standing | None = None,
    console: Console = out,
    read_from: ControllerApi | None = None,
) -> None:
    """Colours and tables in a terminal; the same text without escape codes when piped.
    ``read_from``: the Prefect API the standing was read from, named when not the default."""
    standing = standing or Standing()
    verdict = "[bold green]healthy[/]" if report.healthy else "[bold red]not healthy[/]"
    console.print(f"[bold]cluster {markup_safe(report.cluster)}[/]: {verdict}", highlight=False)
    if standing.headline:
        said = f"[bold yellow]{markup_safe(standing.headline)}[/]"
        console.print(said, highlight=False, soft_wrap=True)
    if read_from is not None and not read_from.is_default():
        line = f"standing read from {markup_safe(read_from.described())}"
        console.print(line, highlight=False, soft_wrap=True)
    for line in _runs_lines(standing):
        console.print(line, highlight=False, soft_wrap=True)
    members = {m.ip: m for m in report.group.members}
    table = Table(show_edge=False, show_lines=True)
    # The group as its backend lists it (Ray's members); "-" where it keeps no list (mp).
    for column in ("node", "reachable", "our containers", "GPU", "group"):
        table.add_column(column, overflow="fold")
    for node in report.nodes:
        table.add_row(
            f"[bold]{markup_safe(node.name)}[/] {node.role}\n{markup_safe(node.address)}",
            f"[green]yes[/] {node.rtt_ms:.1f} ms" if node.reachable else "[red]no[/] (problems)",
            _containers_cell(node),
            _gpu_cell(node.gpu),
            _member_cell(node, members, bool(report.group.members)),
        )
    console.print(table, highlight=False)
    console.print()
    e, engine = report.endpoint, report.engine
    if report.endpoint_serves:
        model = f"[green]{markup_safe(e.served_name)}[/] (/v1/models)"
    else:
        listed = ", ".join(e.models or []) or e.models_error or "nothing"
        model = f"[red]{markup_safe(e.served_name)} is not served[/] ({markup_safe(listed)})"
    if e.probe is None:
        probe = "[red]not sent[/]: the engine does not generate"
    else:
        verdict = "[green]healthy[/]" if e.probe.healthy else "[red]unhealthy[/]"
        probe = f"{verdict}: {markup_safe(e.probe.detail)}"
    generation = "-"
    if e.generation is not None:
        colour = {"answered": "green", "busy": "yellow"}.get(e.generation.verdict, "red")
        generation = f"[{colour}]{e.generation.verdict}[/]: {markup_safe(e.generation.detail)}"
    rows = [
        ("endpoint", markup_safe(e.url)),
        ("backend", markup_safe(report.backend or "-")),
        ("loader", markup_safe(report.loader or "-")),
        ("transport", _transport_cell(report)),
        ("model", model),
        ("health", "[green]200[/]" if e.health == 200 else f"[red]{e.health or 'no answer'}[/]"),
        ("vLLM", markup_safe(e.version or "-")),
        ("generation", generation),
        ("probe", probe),
        (
            "engine",
            f"[green]running[/], up {duration(engine.uptime_s)}"
            if engine is not None and engine.running
            else "[red]not running[/]",
        ),
    ]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(label, value)
    console.print(grid, highlight=False)
    if report.problems:
        console.print()
        console.print("[bold red]problems[/]")
        for problem in report.problems:
            console.print(f"  - {for_terminal(problem)}", markup=False, highlight=False)


def _runs_lines(standing: Standing) -> list[str]:
    lines = []
    if (last := standing.last) is not None:
        when = last.started.astimezone().strftime("%Y-%m-%d %H:%M") if last.started else "-"
        colour = "green" if last.state == "Completed" else "red" if last.failure else "yellow"
        why = f": {markup_safe(one_line(last.failure)[:120])}" if last.failure else ""
        lines.append(
            f"last run   {markup_safe(last.name)} {when}, [{colour}]{markup_safe(last.state)}[/]"
            f" after {duration(last.seconds)}{why}"
        )
    if standing.due is not None:
        trigger, due = standing.due
        lines.append(f"next run   {markup_safe(trigger)}, due {due.astimezone():%Y-%m-%d %H:%M}")
    if (beat := standing.watcher) is not None:
        said = markup_safe(beat.describe())
        lines.append(f"watcher    {said}" if beat.alive() else f"watcher    [red]silent[/]: {said}")
    elif standing.read:
        lines.append("watcher    [yellow]never seen[/]: no `vllm-redeploy watch` looks at it")
    return lines


def _transport_cell(report: ClusterStatus) -> str:
    if report.transport is None:
        return "-"
    colour = "green" if report.transport.transport == "rdma" else "yellow"
    nodes = "; ".join(n.phrase() for n in report.transport.nodes)
    return f"[{colour}]{report.transport.transport}[/] ({markup_safe(nodes)})"


def _containers_cell(node: NodeStatus) -> str:
    if not node.reachable:
        return "-"
    if node.error:
        return f"[red]{markup_safe(node.error)}[/]"
    lines = []
    for c in node.containers:
        if c.running:
            lines.append(f"{markup_safe(c.name)} [green]running[/] {duration(c.uptime_s)}")
        else:
            code = f" (exit {c.exit_code})" if c.exit_code is not None else ""
            lines.append(f"{markup_safe(c.name)} [red]{markup_safe(c.status)}{code}[/]")
    return "\n".join(lines) or "[yellow]none[/]"


def _gpu_cell(gpu: GpuStatus | None) -> str:
    if gpu is None:
        return "-"
    if gpu.clear:
        return "[green]clear[/]"
    if gpu.holders:
        return "\n".join(
            f"[yellow]held[/] by PID {h.pid} {markup_safe(h.name)}"
            + (f", {h.memory_mib} MiB" if h.memory_mib is not None else "")
            for h in gpu.holders
        )
    return "[yellow]" + markup_safe("; ".join(gpu.problems)) + "[/]"


def _member_cell(node: NodeStatus, members: dict[str, GroupMember], known: bool) -> str:
    member = members.get(node.ip)
    if member is None:
        return "[red]not a member[/]" if known else "-"
    state = "[green]alive[/]" if member.alive else "[red]dead[/]"
    return f"{state} at {member.ip}, {member.gpus:g} GPU"
