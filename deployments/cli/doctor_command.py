"""`vllm-redeploy doctor`: the controller's side of a cluster in one screen."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from deployments.cli.common import (
    CHECKS,
    EXIT_FAILED,
    ConfigOption,
    JsonOption,
    app,
    load_or_exit,
    out,
)
from deployments.cli.prefect_api import api_key, find_api, talking_to
from deployments.doctor import (
    Finding,
    deployments,
    env_file,
    lock,
    nodes,
    problems,
    ssh_files,
    watcher,
    webhook,
)
from vllm_redeploy.controller_api import problem_with
from vllm_redeploy.safe_text import for_terminal, one_line


@app.command(rich_help_panel=CHECKS)
def doctor(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """The controller's side of the cluster in one screen: the Prefect API and its auth, the
    deployments served, the SSH key and known_hosts, the env file's mode, the webhook; on every
    node the notifier, the webhook reached from there and the clock. Each problem with its fix;
    exit 1 if any. Changes nothing."""
    cluster = load_or_exit(config)
    found = find_api([cluster], [config])
    findings: list[Finding] = []
    if found.api is None:
        findings.append(Finding("prefect api", False, found.problem, found.fix()))
    elif (problem := problem_with(found.api, api_key())) is not None:
        fix = "`sudo systemctl status vllm-redeploy-prefect`, or the auth string where it is set"
        findings.append(Finding("prefect api", False, problem, fix))
    else:
        findings.append(Finding("prefect api", True, f"{found.api.described()} answers"))
        with talking_to(found.api.environment()):
            checks = ((deployments, "deployments"), (lock, "lock"), (watcher, "watcher"))
            for check, area in checks:
                try:
                    findings.append(check(cluster))
                except Exception as exc:  # the API answered /health, then failed us
                    findings.append(Finding(area, False, f"not read: {one_line(exc)}"))
    findings += ssh_files(cluster)
    findings += [env_file(config), webhook(cluster)]
    findings += nodes(cluster)
    wrong = problems(findings)
    if as_json:
        out.print_json(json.dumps([f.as_dict() for f in findings]))
    else:
        _show(cluster.name, findings, len(wrong))
    if wrong:
        raise typer.Exit(EXIT_FAILED)


def _show(cluster: str, findings: list[Finding], wrong: int) -> None:
    verdict = f"{wrong} problem{'s' if wrong != 1 else ''}" if wrong else "all well"
    out.print(Text(f"cluster {cluster}: {verdict}", "bold red" if wrong else "bold green"))
    grid = Table.grid(padding=(0, 2))
    for _ in range(3):
        grid.add_column(overflow="fold")
    for f in findings:
        mark = Text("✓", "green") if f.ok else Text("✗", "bold red")
        said = Text(for_terminal(f.said))
        if f.fix:
            said.append(f"\nfix: {for_terminal(f.fix)}", "yellow")
        grid.add_row(mark, Text(for_terminal(f.area), "bold"), said)
    out.print(grid)
