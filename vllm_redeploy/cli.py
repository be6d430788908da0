"""The `vllm-redeploy` command line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markdown import Markdown
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from vllm_redeploy.config import (
    ClusterConfig,
    ConfigError,
    NodeConfig,
    describe,
    load_clusters,
    load_config,
)
from vllm_redeploy.endpoint import api_base
from vllm_redeploy.gpus import GpuReport, inspect_gpus
from vllm_redeploy.nodes import NodeAccess, RemoteError, check_node, fan_out
from vllm_redeploy.parsers.vllm_log import LoadProgress
from vllm_redeploy.plan import RayMember
from vllm_redeploy.probe import run_probe
from vllm_redeploy.safe_text import for_terminal, one_line, shown
from vllm_redeploy.status import ClusterStatus, GpuStatus, NodeStatus, collect_status, duration
from vllm_redeploy.summary import StepEvent, listening

EXIT_CONFIG = 2  # bad input, like argparse and click
EXIT_UNREACHABLE = 1

app = typer.Typer(
    help="Bring a multi-node vLLM server back by itself.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# Piped output is not cut at 80 columns: it goes to logs and other programs.
out = Console(width=None if Console().is_terminal else 200)
err = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 200)

ConfigOption = Annotated[
    Path,
    typer.Option("--config", "-c", help="Cluster configuration (TOML).", show_default=True),
]
ConfigsOption = Annotated[
    list[Path],
    typer.Option(
        "--config",
        "-c",
        help="A cluster's configuration (TOML); repeat for several (each with its own env file).",
        show_default=True,
    ),
]
CONFIGS_DEFAULT = [Path("cluster.toml")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _t(value: object) -> str:
    """A foreign value inside our rich markup: no escape sequences, no markup of its own."""
    return escape(for_terminal(value))


def _load(path: Path) -> ClusterConfig:
    return _load_many([path])[0]


def _load_many(paths: list[Path]) -> list[ClusterConfig]:
    try:
        return load_clusters(paths) if len(paths) > 1 else [load_config(paths[0])]
    except ConfigError as exc:
        err.print(f"[bold red]Configuration problem in {_t(shown(exc.source))}[/]", highlight=False)
        for problem in exc.problems:
            err.print(f"  - {for_terminal(problem)}", highlight=False, markup=False)
        err.print(
            "Fix the keys named above (see cluster.example.toml), then run "
            "`vllm-redeploy check-config` again.",
            highlight=False,
        )
        raise typer.Exit(EXIT_CONFIG) from None


@app.command("check-config")
def check_config(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Validate the configuration and print it resolved (secrets masked)."""
    cluster = _load(config)
    data = describe(cluster)
    if as_json:
        out.print_json(json.dumps(data))
        return
    table = Table(title=f"cluster {cluster.name}: {len(cluster.nodes)} nodes")
    for column in ("node", "role", "address", "transport", "fabric ip", "interfaces", "gpus"):
        table.add_column(column)
    for node in cluster.nodes:
        table.add_row(
            node.name,
            "head" if node is cluster.head else "worker",
            f"{node.address}:{node.ssh_port}" if node.transport == "ssh" else "(this machine)",
            node.transport,
            node.ip,
            ",".join(node.fabric_interfaces) or "-",
            str(node.gpus),
        )
    out.print(table)
    for section in ("vllm", "ray", "autostart", "deadlines", "probe", "webhook", "ssh", "secrets"):
        out.print(f"[bold]\\[{section}][/]")
        for key, value in data[section].items():
            out.print(f"  {key} = {_show(value)}", highlight=False, markup=False, soft_wrap=True)
    out.print("[green]configuration OK[/]")


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else shown(value)


@app.command()
def nodes(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Contact every node in parallel: reachable, SSH round trip, Docker version."""
    cluster = _load(config)
    reports = [o.value for o in fan_out(cluster.nodes, lambda n: check_node(n, cluster))]
    if as_json:
        out.print_json(json.dumps([asdict(r) for r in reports if r is not None]))
    else:
        table = Table(title=f"cluster {cluster.name}")
        for column in ("node", "address", "reachable", "round trip", "docker", "fabric", "problem"):
            table.add_column(column, overflow="fold")
        for r in reports:
            assert r is not None
            table.add_row(
                r.name,
                r.address if r.transport == "ssh" else "local",
                "[green]yes[/]" if r.reachable else "[red]no[/]",
                f"{r.rtt_ms:.1f} ms" if r.rtt_ms is not None else "-",
                _t(r.docker_version or "-"),
                _fabric_cell(r.fabric),
                _t("; ".join(filter(None, [r.error, *(r.fabric or {}).get("problems", [])]))),
            )
        out.print(table)
    if not all(r is not None and r.reachable and r.docker_version for r in reports):
        raise typer.Exit(EXIT_UNREACHABLE)


def _fabric_cell(fabric: dict[str, Any] | None) -> str:
    if fabric is None:
        return "-"
    where = f"{fabric['interface'] or 'no interface'} (MTU {fabric['mtu'] or '?'})"
    if fabric["twins"]:
        where += f" + {', '.join(fabric['twins'])}"
    hcas = []
    for h in fabric["hcas"]:
        state = "[green]ACTIVE[/]" if h["state"] == "ACTIVE" else f"[red]{_t(h['state'])}[/]"
        hcas.append(f"{_t(h['name'])}:{h['port']} {state}")
    return _t(where) + "\n" + ("\n".join(hcas) if hcas else "no RDMA HCA")


@app.command()
def fabric(
    log: Annotated[Path, typer.Option("--log", help="A saved log with NCCL's INFO lines.")],
    as_json: JsonOption = False,
) -> None:
    """Judge which transport NCCL chose in a saved log: exit 0 iff every rank used RDMA."""
    from vllm_redeploy.parsers.nccl_log import judge_transport

    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        err.print(f"cannot read {shown(str(log))}: {exc.strerror}", markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG) from None
    verdict = judge_transport(text)
    if as_json:
        out.print_json(json.dumps(verdict.as_dict()))
    else:
        colour = "green" if verdict.transport == "rdma" else "red"
        out.print(f"transport: [{colour}]{verdict.transport}[/]", highlight=False)
        if verdict.hcas:
            out.print(f"HCAs: {_t(', '.join(verdict.hcas))}", highlight=False)
        for rank in verdict.ranks:
            network = rank.network or "no choice logged"
            line = f"  {rank.identity}: {network}"
            if rank.hcas:
                line += f" over {', '.join(rank.hcas)}"
            out.print(for_terminal(line), markup=False, highlight=False)
    if verdict.transport != "rdma":
        raise typer.Exit(EXIT_UNREACHABLE)


@app.command()
def status(config: ConfigsOption = CONFIGS_DEFAULT, as_json: JsonOption = False) -> None:
    """The deployment now: nodes, containers, GPUs, Ray, endpoint, probe; one screen per
    cluster (repeat --config). Exit 0 iff every cluster is healthy."""
    clusters = _load_many(config)
    with ThreadPoolExecutor(max_workers=2 * len(clusters)) as pool:
        standings = [pool.submit(_standing, c.name) for c in clusters]
        reports = list(pool.map(collect_status, clusters))
        held = [s.result() for s in standings]
    if as_json:
        found = [{**r.as_dict(), "standing": h} for r, h in zip(reports, held, strict=True)]
        out.print_json(json.dumps(found[0] if len(found) == 1 else found))
    else:
        for i, (report, standing) in enumerate(zip(reports, held, strict=True)):
            if i:
                out.rule(style="dim")
            _print_status(report, standing)
    if not all(r.healthy for r in reports):
        raise typer.Exit(EXIT_UNREACHABLE)


def _standing(cluster: str) -> str | None:
    """Paused or crash-looping (kept in Prefect), when a Prefect API is configured to ask."""
    if not os.environ.get("PREFECT_API_URL"):
        return None
    from deployments.cluster_state import read_standing

    try:
        return read_standing(cluster).headline()
    except Exception as exc:  # status must work while Prefect is down
        return f"unknown (Prefect did not answer: {one_line(exc)[:200]})"


def _print_status(report: ClusterStatus, standing: str | None = None) -> None:
    """Colours and tables in a terminal; the same text without escape codes when piped."""
    verdict = "[bold green]healthy[/]" if report.healthy else "[bold red]not healthy[/]"
    out.print(f"[bold]cluster {_t(report.cluster)}[/]: {verdict}", highlight=False)
    if standing:
        out.print(f"[bold yellow]{_t(standing)}[/]", highlight=False)
    members = {m.ip: m for m in report.ray.members}
    table = Table(show_edge=False, show_lines=True)
    for column in ("node", "reachable", "our containers", "GPU", "Ray"):
        table.add_column(column, overflow="fold")
    for node in report.nodes:
        table.add_row(
            f"[bold]{_t(node.name)}[/] {node.role}\n{_t(node.address)}",
            f"[green]yes[/] {node.rtt_ms:.1f} ms"
            if node.reachable
            else f"[red]no[/]: {_t(node.error or '')}",
            _containers_cell(node),
            _gpu_cell(node.gpu),
            _ray_cell(node, members, bool(report.ray.members)),
        )
    out.print(table, highlight=False)
    out.print()
    e, engine = report.endpoint, report.engine
    if report.endpoint_serves:
        model = f"[green]{_t(e.served_name)}[/] (/v1/models)"
    else:
        listed = ", ".join(e.models or []) or e.models_error or "nothing"
        model = f"[red]{_t(e.served_name)} is not served[/] ({_t(listed)})"
    probe = "[green]healthy[/]" if e.probe.healthy else "[red]unhealthy[/]"
    rows = [
        ("endpoint", _t(e.url)),
        ("backend", _t(report.backend or "-")),
        ("transport", _transport_cell(report)),
        ("model", model),
        ("health", "[green]200[/]" if e.health == 200 else f"[red]{e.health or 'no answer'}[/]"),
        ("vLLM", _t(e.version or "-")),
        ("probe", f"{probe}: {_t(e.probe.detail)}"),
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
    out.print(grid, highlight=False)
    if report.problems:
        out.print()
        out.print("[bold red]problems[/]")
        for problem in report.problems:
            out.print(f"  - {for_terminal(problem)}", markup=False, highlight=False)


def _transport_cell(report: ClusterStatus) -> str:
    if report.transport is None:
        return "-"
    colour = "green" if report.transport.transport == "rdma" else "yellow"
    nodes = "; ".join(n.phrase() for n in report.transport.nodes)
    return f"[{colour}]{report.transport.transport}[/] ({_t(nodes)})"


def _containers_cell(node: NodeStatus) -> str:
    if not node.reachable:
        return "-"
    if node.error:
        return f"[red]{_t(node.error)}[/]"
    lines = []
    for c in node.containers:
        if c.running:
            lines.append(f"{_t(c.name)} [green]running[/] {duration(c.uptime_s)}")
        else:
            code = f" (exit {c.exit_code})" if c.exit_code is not None else ""
            lines.append(f"{_t(c.name)} [red]{_t(c.status)}{code}[/]")
    return "\n".join(lines) or "[yellow]none[/]"


def _gpu_cell(gpu: GpuStatus | None) -> str:
    if gpu is None:
        return "-"
    if gpu.clear:
        return "[green]clear[/]"
    if gpu.holders:
        return "\n".join(
            f"[yellow]held[/] by PID {h.pid} {_t(h.name)}"
            + (f", {h.memory_mib} MiB" if h.memory_mib is not None else "")
            for h in gpu.holders
        )
    return "[yellow]" + _t("; ".join(gpu.problems)) + "[/]"


def _ray_cell(node: NodeStatus, members: dict[str, RayMember], known: bool) -> str:
    member = members.get(node.ip)
    if member is None:
        return "[red]not a member[/]" if known else "-"
    state = "[green]alive[/]" if member.alive else "[red]dead[/]"
    return f"{state} at {member.ip}, {member.gpus:g} GPU"


@app.command("run")
def run_command(
    config: ConfigOption = Path("cluster.toml"),
    mode: Annotated[
        str, typer.Option(help="redeploy, or ensure: only if not healthy")
    ] = "redeploy",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan, change nothing.")
    ] = False,
    keep_on_failure: Annotated[
        bool, typer.Option("--keep-on-failure", help="Leave a failed group running to debug it.")
    ] = False,
) -> None:
    """Run the redeploy flow once (a temporary Prefect API unless PREFECT_API_URL is set)."""
    if mode not in ("redeploy", "ensure"):
        err.print(f"--mode must be redeploy or ensure, not {mode!r}", highlight=False)
        raise typer.Exit(EXIT_CONFIG)
    cluster = _load(config)
    if dry_run:
        from vllm_redeploy.dry_run import plan_lines

        for line in plan_lines(cluster):
            out.print(for_terminal(line), highlight=False, markup=False, soft_wrap=True)
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")  # Prefect's client telemetry (3.9), separately
    from flows.redeploy import redeploy_vllm_cluster
    from tasks.context import StepFailed

    # In a terminal a live view of the steps; piped, one plain line per step.
    view = StepView(f"{cluster.name}: {mode}") if out.is_terminal else None
    try:
        with _showing(view), listening(view or PlainSteps(out)):
            result = redeploy_vllm_cluster(str(config), mode, keep_on_failure)  # type: ignore[arg-type]
    except StepFailed as exc:
        err.print(f"[bold red]failed at {exc.step}[/]: ", end="", highlight=False)
        err.print(for_terminal(exc.reason), markup=False, highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except RemoteError as exc:
        err.print("[bold red]failed[/]: ", end="", highlight=False)
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    markdown = for_terminal(result.get("summary") or f"# {result['cluster']}: {result['action']}\n")
    if view is not None:
        out.print(Markdown(markdown))
    else:
        out.print(markdown, markup=False, highlight=False, soft_wrap=True, end="")


@contextlib.contextmanager
def _showing(view: StepView | None) -> Iterator[None]:
    """Draw ``view`` live (if any); Prefect's console log shows warnings above it."""
    if view is None:
        with _prefect_console(None):
            yield
        return
    # Success: the summary repeats the steps, so the live rows go. Failure: they stay.
    with (
        Live(view, console=out, refresh_per_second=8, transient=True) as display,
        _prefect_console(out),
    ):
        try:
            yield
        except BaseException:
            display.transient = False
            raise


@contextlib.contextmanager
def _prefect_console(live: Console | None) -> Iterator[None]:
    """What Prefect's console handler prints while a run goes: plain text (no markup, no escape
    sequences) and no tracebacks (the failure is printed once, at the end, in words; the
    traceback stays in the Prefect API's log, in the UI). With a live view (``live``), it prints
    through that console, above the view, and only warnings: the view replaces its INFO lines."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *map(logging.getLogger, logging.root.manager.loggerDict)]
    handlers = {
        id(h): h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)
    }.values()
    quiet = _WarningsOnly()
    saved = [(h, h.console, h.formatter) for h in handlers]
    for handler in handlers:
        handler.console = _PlainPrinter(live or handler.console)  # type: ignore[assignment]
        handler.setFormatter(_WithoutTraceback(handler.formatter or logging.Formatter()))
        if live is not None:
            handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler, console, formatter in saved:
            handler.console = console
            handler.setFormatter(formatter)  # type: ignore[arg-type]
            handler.removeFilter(quiet)


class _WithoutTraceback(logging.Formatter):
    """Formats a record as ``inner`` does, leaving its traceback out (for this handler only:
    the record itself is given back unchanged to the handlers after it)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


class _PlainPrinter:
    """What Prefect's handler prints through: a log line is text, never rich markup."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def print(self, *objects: Any, **kwargs: Any) -> None:
        safe = [for_terminal(o) if isinstance(o, str) else o for o in objects]
        self.console.print(*safe, markup=False, highlight=False, soft_wrap=True)


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return logging.WARNING <= record.levelno < logging.ERROR


class StepView:
    """The live view of a run: one row per step as it starts (a spinner, then a check mark or a
    cross), its elapsed time, and a bar while the weights load."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._start = _StepRow("starting the flow run")  # until the first step begins
        self._rows: dict[str, _StepRow] = {}
        self._lock = threading.Lock()

    def __call__(self, event: StepEvent) -> None:
        with self._lock:
            row = self._rows.get(event.step)
            if row is None or event.state == "running":
                row = self._rows[event.step] = _StepRow(event.step)
            if event.state in ("done", "failed"):
                row.state = event.state
                row.seconds = (
                    event.seconds if event.seconds is not None else time.monotonic() - row.started
                )
            elif event.state == "loading" and event.load is not None:
                row.load = event.load

    def __rich__(self) -> RenderableType:
        grid = Table.grid(padding=(0, 2))
        for _ in range(4):
            grid.add_column()
        with self._lock:
            rows = list(self._rows.values()) or [self._start]
        now = time.monotonic()
        for row in rows:
            if row.state == "running":
                glyph: RenderableType = row.spinner
                seconds = now - row.started
            else:
                glyph = Text("✓", "green") if row.state == "done" else Text("✗", "bold red")
                seconds = row.seconds or 0.0
            load: RenderableType = ""
            if row.load is not None:
                bar = ProgressBar(total=100, completed=row.load.percent, width=30)
                shards = f" {row.load.done}/{row.load.total} shards" if row.load.total else ""
                load = Columns([bar, Text(f"{row.load.percent:3d}%{shards}")])
            grid.add_row(glyph, Text(row.step, "bold"), Text(_clock(seconds), "cyan"), load)
        return Group(Text(self.title, "bold"), grid)


@dataclass
class _StepRow:
    step: str
    started: float = field(default_factory=time.monotonic)
    state: str = "running"
    seconds: float | None = None
    load: LoadProgress | None = None
    spinner: Spinner = field(default_factory=lambda: Spinner("dots", style="yellow"))


class PlainSteps:
    """Piped output: one plain line per step as it ends."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: StepEvent) -> None:
        if event.state == "done":
            line = f"{event.step}: done in {event.seconds or 0:.1f} s"
        elif event.state == "failed":
            after = f" after {event.seconds:.1f} s" if event.seconds is not None else ""
            line = f"{event.step}: failed{after}"
        else:
            return
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def _clock(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:5.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes:2d}:{rest:02d}  "


@app.command()
def probe(
    config: ConfigOption = Path("cluster.toml"),
    url: Annotated[str | None, typer.Option(help="Base URL, e.g. http://head:30000")] = None,
    model: Annotated[str | None, typer.Option(help="Served model name")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Token budget")] = None,
    as_json: JsonOption = False,
) -> None:
    """Send the reasoning-aware sanity probe. Exit 0 iff the model answers healthily."""
    if url and model:
        prompt, tokens, temperature, timeout = "Say hello in one sentence.", 50, 0.0, 60.0
    else:
        cluster = _load(config)
        url = url or api_base(cluster)
        model = model or cluster.vllm.served_name
        p = cluster.probe
        prompt, tokens, temperature, timeout = p.prompt, p.max_tokens, p.temperature, p.timeout_s
    verdict = run_probe(url, model, prompt, max_tokens or tokens, temperature, timeout)
    if as_json:
        out.print_json(json.dumps(verdict.as_dict()))
    else:
        colour = "green" if verdict.healthy else "red"
        state = "healthy" if verdict.healthy else "unhealthy"
        out.print(f"[{colour}]{state}[/]: ", end="", highlight=False)
        out.print(for_terminal(verdict.detail), markup=False, highlight=False)
    if not verdict.healthy:
        raise typer.Exit(EXIT_UNREACHABLE)


@app.command("check-gpus")
def check_gpus(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Are the GPUs of every node free? Exit 0 iff all are clear."""
    cluster = _load(config)

    def inspect(node: NodeConfig) -> GpuReport:
        with NodeAccess(node, cluster) as access:
            return inspect_gpus(node.name, access.runner)

    outcomes = fan_out(cluster.nodes, inspect)
    rows = []
    for o in outcomes:
        if o.value is not None:
            report = o.value
            rows.append(
                {
                    "node": o.node,
                    "clear": report.clear,
                    "problems": report.problems,
                    "processes": [
                        {"pid": p.pid, "name": p.process_name, "memory_mib": p.used_mib}
                        for p in report.processes
                    ],
                }
            )
        else:
            rows.append(
                {"node": o.node, "clear": False, "problems": [str(o.error)], "processes": []}
            )
    if as_json:
        out.print_json(json.dumps(rows))
    else:
        for row in rows:
            state = "[green]clear[/]" if row["clear"] else "[red]busy[/]"
            out.print(f"{row['node']}: {state}", highlight=False)
            for problem in row["problems"]:
                out.print(f"  {for_terminal(problem)}", markup=False, highlight=False)
    if not all(row["clear"] for row in rows):
        raise typer.Exit(EXIT_UNREACHABLE)


@app.command()
def serve(config: ConfigsOption = CONFIGS_DEFAULT) -> None:
    """Serve the nightly, after-reboot, recover and manual deployments of each cluster (repeat
    --config for several) from this process (no work pool)."""
    clusters = _load_many(config)  # fail early, in plain words, on a bad configuration
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from deployments.definitions import serve_deployments

    serve_deployments(list(zip(clusters, config, strict=True)))


@app.command()
def watch(config: ConfigsOption = CONFIGS_DEFAULT) -> None:
    """Watch clusters between runs; tell Prefect (vllm.cluster.unhealthy) when one goes down."""
    clusters = _load_many(config)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per look is noise
    from deployments.watcher import watch_clusters

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        watch_clusters(clusters, stop)
    except KeyboardInterrupt:
        stop.set()


@app.command()
def pause(
    reason: Annotated[str, typer.Option("--reason", help="Why, for whoever looks (required).")],
    for_: Annotated[
        str | None,
        typer.Option("--for", help="For how long, e.g. 2h, 30m, 90s (default: until resume)."),
    ] = None,
    config: ConfigOption = Path("cluster.toml"),
) -> None:
    """Maintenance: nothing automatic touches the cluster (watcher, recover, reboot, nightly)."""
    cluster = _load(config)
    seconds = _duration_s(for_) if for_ else None
    from deployments.cluster_state import pause as pause_cluster

    paused = pause_cluster(cluster.name, reason, seconds)
    out.print(f"{cluster.name}: {for_terminal(paused.describe())}", markup=False, highlight=False)


@app.command()
def resume(config: ConfigOption = Path("cluster.toml")) -> None:
    """End a pause and a crash-loop mark: automatic runs may touch the cluster again."""
    cluster = _load(config)
    from deployments.cluster_state import resume as resume_cluster

    cleared = resume_cluster(cluster.name)
    what = " and ".join(cleared) or "nothing (it was neither paused nor crash-looping)"
    out.print(f"{cluster.name}: cleared {what}", markup=False, highlight=False)


def _duration_s(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        err.print(
            f"--for {shown(text)}: give a number with s, m, h or d, e.g. 2h or 30m", markup=False
        )
        raise typer.Exit(EXIT_CONFIG)
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


@app.command()
def webhook(
    config: ConfigsOption = CONFIGS_DEFAULT,
    host: Annotated[str | None, typer.Option(help="Bind address (default webhook.host)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default webhook.port)")] = None,
) -> None:
    """Run the reboot webhook: signed calls from the nodes become Prefect events. With several
    --config, one webhook serves each cluster at /clusters/NAME/reboot with its own secret."""
    clusters = _load_many(config)
    from deployments.webhook import serve_webhook

    try:
        serve_webhook(clusters, host, port)
    except ValueError as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command("install-notifier")
def install_notifier_command(
    node: Annotated[str, typer.Argument(help="Node name from the configuration")],
    config: ConfigOption = Path("cluster.toml"),
    prefix: Annotated[str, typer.Option(help="Install below this root (test beds)")] = "/",
) -> None:
    """Install the reboot notifier on NODE over SSH (idempotent); prints what changed."""
    cluster = _load(config)
    from deployments.install_notifier import install_notifier

    try:
        for line in install_notifier(cluster, node, prefix):
            out.print(for_terminal(line), markup=False, highlight=False)
    except ValueError as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG) from None
    except RemoteError as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None


@app.command("install-controller")
def install_controller_command(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Install as /etc/vllm-redeploy/<cluster>.toml"),
    ] = None,
    cluster: Annotated[
        str | None, typer.Option(help="Cluster name (default: the configuration's name)")
    ] = None,
    prefix: Annotated[str, typer.Option(help="Install below this root (images, chroots)")] = "/",
    bin_dir: Annotated[
        str | None, typer.Option(help="Where the units find vllm-redeploy and prefect")
    ] = None,
    enable: Annotated[bool, typer.Option("--enable", help="daemon-reload and enable")] = False,
) -> None:
    """Install the controller's systemd units (Prefect server; serve, webhook and watch of a
    cluster), their user and settings (idempotent); prints what changed."""
    if config is not None:
        name = _load(config).name
        if cluster not in (None, name):
            err.print(f"--cluster {shown(cluster)} but {config} names {shown(name)}", markup=False)
            raise typer.Exit(EXIT_CONFIG)
        cluster = name
    from deployments.install_controller import InstallError, install_controller

    try:
        lines = install_controller(
            prefix, cluster=cluster, config_file=config, bin_dir=bin_dir, enable=enable
        )
    except (ValueError, InstallError) as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG if isinstance(exc, ValueError) else 1) from None
    except OSError as exc:  # a file it writes: read-only, no space, ...
        where = f"{exc.filename}: " if exc.filename else ""
        err.print(f"install-controller: {where}{for_terminal(exc.strerror or exc)}", markup=False)
        raise typer.Exit(1) from None
    for line in lines:
        out.print(for_terminal(line), markup=False, highlight=False)


def main() -> None:
    app()
