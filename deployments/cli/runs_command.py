"""`vllm-redeploy runs`: the cluster's last flow runs, whatever started them, with why one
failed and where the UI shows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from deployments.cli.common import EVERYDAY, ConfigOption, JsonOption, app, load_or_exit, out
from deployments.cli.prefect_api import controller_or_exit
from vllm_redeploy.safe_text import for_terminal, one_line
from vllm_redeploy.status import duration

if TYPE_CHECKING:
    from tasks.standing.runs import PastRun

STYLES = {"Completed": "green", "Failed": "bold red", "Crashed": "bold red", "Skipped": "yellow"}


@app.command(rich_help_panel=EVERYDAY)
def runs(
    config: ConfigOption = Path("cluster.toml"),
    count: Annotated[
        int, typer.Option("--count", "-n", metavar="N", min=1, help="How many runs.")
    ] = 10,
    as_json: JsonOption = False,
) -> None:
    """The cluster's last runs, newest first: trigger (nightly, after-reboot, recover, manual),
    mode, result, how long, the failed step and why, and the run's page in the Prefect UI."""
    cluster = load_or_exit(config)
    from tasks.standing.runs import last_runs  # Prefect's client: after the CLI chose its cwd

    with controller_or_exit([cluster], [config], "runs"):
        found = last_runs(cluster, count)
    if as_json:
        out.print_json(json.dumps([run.as_dict() for run in found]))
        return
    if not found:
        out.print(f"{cluster.name}: no run yet", markup=False, highlight=False)
        return
    if not out.is_terminal:  # one line per run: grep and awk read it, --json for the rest
        for run in found:
            why = f": {one_line(run.failure)}" if run.failure else ""
            line = (
                f"{_when(run)} {run.name} ({run.trigger}, {run.mode}): {run.state} after "
                f"{duration(run.seconds)}{why}  {run.url}"
            )
            out.print(for_terminal(line), markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=f"{cluster.name}: the last {len(found)} runs", title_justify="left")
    for column in ("started", "run", "trigger", "mode", "result", "took", "why"):
        table.add_column(column, overflow="fold")
    for run in found:
        name = Text(for_terminal(run.name))
        if run.url:
            name.stylize(f"link {run.url}")  # the terminal opens the run's page in the UI
        table.add_row(
            _when(run),
            name,
            run.trigger,
            run.mode,
            Text(for_terminal(run.state), STYLES.get(run.state, "")),
            duration(run.seconds),
            Text(for_terminal(one_line(run.failure))[:120]),
        )
    out.print(table)


def _when(run: PastRun) -> str:
    return run.started.astimezone().strftime("%m-%d %H:%M:%S") if run.started else "not started"
