"""`vllm-redeploy run`: the flow once, with a live view of its steps in a terminal (one plain
line per step when piped) and its summary at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markdown import Markdown
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from deployments.cli.common import (
    EVERYDAY,
    EXIT_FAILED,
    ConfigOption,
    app,
    err,
    load_or_exit,
    out,
)
from deployments.cli.prefect_api import TemporaryApiOption, controller_or_exit, temporary_api
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.nodes import RemoteError
from vllm_redeploy.parsers.vllm_log import LoadProgress
from vllm_redeploy.safe_text import for_terminal
from vllm_redeploy.summary import StepEvent, listening


@app.command("run", rich_help_panel=EVERYDAY)
def run_command(
    config: ConfigOption = Path("cluster.toml"),
    mode: Annotated[
        Literal["redeploy", "ensure"],
        typer.Option(help="redeploy, or ensure: only if not healthy"),
    ] = "redeploy",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan, change nothing.")
    ] = False,
    keep_on_failure: Annotated[
        bool, typer.Option("--keep-on-failure", help="Leave a failed group running to debug it.")
    ] = False,
    override_pause: Annotated[
        bool,
        typer.Option(
            "--override-pause",
            help="Run even while the cluster is paused or marked crash-looping (the pause "
            "stays: automatic runs still leave it alone).",
        ),
    ] = False,
    temporary: TemporaryApiOption = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="At the end, the run as `runs --json` shows it, with what it did; the steps "
            "go to stderr.",
        ),
    ] = False,
) -> None:
    """Run the redeploy flow once, on the controller's Prefect API (PREFECT_API_URL, else the
    cluster's env file, else the installed units); refused when none is found."""
    cluster = load_or_exit(config)
    if dry_run:  # asks the nodes only, never Prefect
        from vllm_redeploy.dry_run import plan_lines

        for line in plan_lines(cluster):
            out.print(for_terminal(line), highlight=False, markup=False, soft_wrap=True)
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")  # Prefect's client telemetry (3.9), separately
    if temporary:
        with temporary_api([cluster], [config]):
            _run(cluster, config, mode, keep_on_failure, override_pause, as_json)
        return
    with controller_or_exit([cluster], [config], "run"):
        _run(cluster, config, mode, keep_on_failure, override_pause, as_json)


@app.command(rich_help_panel=EVERYDAY)
def stop(
    config: ConfigOption = Path("cluster.toml"),
    pause: Annotated[
        bool,
        typer.Option(
            "--pause",
            help="Pause the cluster first, so that the watcher, the nightly and the "
            "after-reboot runs leave it down until `resume`.",
        ),
    ] = False,
    reason: Annotated[
        str, typer.Option(metavar="TEXT", help="Why, with --pause, for whoever looks.")
    ] = "stopped with `vllm-redeploy stop --pause`",
    as_json: Annotated[
        bool,
        typer.Option("--json", help="At the end, the run as `runs --json` shows it."),
    ] = False,
) -> None:
    """Remove the group on purpose, under the cluster's lock, and prove it gone: the GPUs clear,
    nothing listening on its ports. A pause does not hold it back. Without --pause the watcher
    brings it back."""
    cluster = load_or_exit(config)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    with controller_or_exit([cluster], [config], "stop"):
        if pause:  # first: a recovery that would start now ends Skipped
            from tasks.standing.marks import pause as pause_cluster

            paused = pause_cluster(cluster.name, reason, None)
            said = f"{cluster.name}: {for_terminal(paused.describe())}"
            (err if as_json else out).print(said, markup=False, highlight=False, soft_wrap=True)
        _run(cluster, config, "stop", False, override_pause=True, as_json=as_json)
    if not pause:
        err.print(
            f"{cluster.name}: stopped, not paused: the watcher's recovery (if it runs) brings "
            "it back; `vllm-redeploy stop --pause` keeps it down.",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _run(
    cluster: ClusterConfig,
    config: Path,
    mode: str,
    keep_on_failure: bool,
    override_pause: bool,
    as_json: bool = False,
) -> None:
    """The flow once, shown as it goes; its failure, or why it changed nothing (paused), in
    words (exit 1). With ``as_json``, stdout holds only the run, as JSON, at the end."""
    from prefect.exceptions import CancelledRun

    from flows.redeploy import redeploy_vllm_cluster
    from tasks.context import StepFailed

    # In a terminal a live view of the steps; piped, one plain line per step.
    view = StepView(f"{cluster.name}: {mode}") if out.is_terminal and not as_json else None
    steps = err if as_json else out
    ended: list[Any] = []  # the flow run's final state
    try:
        with (
            _showing(view),
            listening(_Named(steps)),
            listening(view or PlainSteps(steps)),
            _as_json(ended, as_json),
        ):
            state = redeploy_vllm_cluster(
                str(config),
                mode,  # type: ignore[arg-type]
                keep_on_failure,
                override_pause=override_pause,
                return_state=True,
            )
            ended.append(state)
            result = state.result()  # raises the run's failure
    except StepFailed as exc:
        err.print(f"[bold red]failed at {exc.step}[/]: ", end="", highlight=False)
        err.print(for_terminal(exc.reason), markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED) from None
    except RemoteError as exc:
        err.print("[bold red]failed[/]: ", end="", highlight=False)
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED) from None
    except CancelledRun as exc:  # paused while it worked: not served, and not a failure
        err.print("[bold yellow]cancelled[/]: ", end="", highlight=False)
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED) from None
    markdown = for_terminal(result.get("summary") or f"# {result['cluster']}: {result['action']}\n")
    if as_json:
        pass
    elif view is not None:
        out.print(Markdown(markdown))
    else:
        out.print(markdown, markup=False, highlight=False, soft_wrap=True, end="")
    if result["action"].startswith("skipped"):  # held back: nothing was done
        err.print(
            f"{cluster.name}: nothing was done ({for_terminal(result['action'])}). `vllm-redeploy "
            "run --override-pause` runs it anyway; `vllm-redeploy resume` ends the pause.",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_FAILED)


class _Named:
    """The flow run's name and link, first, and kept (above the live view, in a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: StepEvent) -> None:
        if event.state == "named":
            said = for_terminal(event.detail)
            self.console.print(said, markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _as_json(ended: list[Any], wanted: bool) -> Iterator[None]:
    """On the way out, however the run ended: the run as `runs --json` shows it, with what it
    did (``action``, ``steps``, ``probe``; null unless it completed)."""
    try:
        yield
    finally:
        if wanted and ended:
            _print_json(ended[0])


def _print_json(state: Any) -> None:
    from tasks.standing.runs import past_run

    data = past_run(state.state_details.flow_run_id).as_dict()
    done = state.result(raise_on_failure=False) if state.is_completed() else None
    done = done if isinstance(done, dict) else {}
    data.update({key: done.get(key) for key in ("action", "steps", "probe")})
    out.print_json(json.dumps(data, default=str))


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
            elif event.state == "copying":
                row.copies[event.detail.split(":", 1)[0]] = event.detail

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
                shown = row.load.total or row.load.amount
                shards = f" {row.load.words()}" if shown else ""
                load = Columns([bar, Text(f"{row.load.percent:3d}%{shards}")])
            elif row.copies and row.state == "running":
                load = Text("\n".join(row.copies.values()))
            grid.add_row(glyph, Text(row.step, "bold"), Text(_clock(seconds), "cyan"), load)
        return Group(Text(self.title, "bold"), grid)


@dataclass
class _StepRow:
    step: str
    started: float = field(default_factory=time.monotonic)
    state: str = "running"
    seconds: float | None = None
    load: LoadProgress | None = None
    copies: dict[str, str] = field(default_factory=dict)  # per target node, its copy's progress
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
