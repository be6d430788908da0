"""The `vllm-redeploy` command line."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from vllm_redeploy.config import ClusterConfig, ConfigError, describe, load_config
from vllm_redeploy.nodes import check_node, fan_out

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
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _load(path: Path) -> ClusterConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        err.print(f"[bold red]Configuration problem in {exc.source}[/]", highlight=False)
        for problem in exc.problems:
            err.print(f"  - {problem}", highlight=False, markup=False)
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
    for section in ("vllm", "ray", "autostart", "deadlines", "probe", "ssh", "secrets"):
        out.print(f"[bold]\\[{section}][/]")
        for key, value in data[section].items():
            out.print(f"  {key} = {_show(value)}", highlight=False, markup=False, soft_wrap=True)
    out.print("[green]configuration OK[/]")


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


@app.command()
def nodes(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Contact every node in parallel: reachable, SSH round trip, Docker version."""
    cluster = _load(config)
    reports = [o.value for o in fan_out(cluster.nodes, lambda n: check_node(n, cluster))]
    if as_json:
        out.print_json(json.dumps([asdict(r) for r in reports if r is not None]))
    else:
        table = Table(title=f"cluster {cluster.name}")
        for column in ("node", "address", "reachable", "round trip", "docker", "problem"):
            table.add_column(column, overflow="fold")
        for r in reports:
            assert r is not None
            table.add_row(
                r.name,
                r.address if r.transport == "ssh" else "local",
                "[green]yes[/]" if r.reachable else "[red]no[/]",
                f"{r.rtt_ms:.1f} ms" if r.rtt_ms is not None else "-",
                r.docker_version or "-",
                r.error or "",
            )
        out.print(table)
    if not all(r is not None and r.reachable and r.docker_version for r in reports):
        raise typer.Exit(EXIT_UNREACHABLE)


def main() -> None:
    app()
