"""The `vllm-redeploy` command line."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from vllm_redeploy.config import ClusterConfig, ConfigError, NodeConfig, describe, load_config
from vllm_redeploy.gpus import GpuReport, inspect_gpus
from vllm_redeploy.nodes import NodeAccess, RemoteError, check_node, fan_out
from vllm_redeploy.probe import run_probe

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
    for section in ("vllm", "ray", "autostart", "deadlines", "probe", "webhook", "ssh", "secrets"):
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
            out.print(line, highlight=False, markup=False, soft_wrap=True)
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.redeploy import redeploy_vllm_cluster
    from tasks.context import StepFailed

    try:
        result = redeploy_vllm_cluster(str(config), mode, keep_on_failure)  # type: ignore[arg-type]
    except StepFailed as exc:
        err.print(f"[bold red]failed at {exc.step}[/]: ", end="", highlight=False)
        err.print(exc.reason, markup=False, highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except RemoteError as exc:
        err.print("[bold red]failed[/]: ", end="", highlight=False)
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    out.print(f"[green]{result['cluster']}: {result['action']}[/]", highlight=False)


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
        url = url or f"http://{cluster.head.address}:{cluster.vllm.port}"
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
        out.print(verdict.detail, markup=False, highlight=False)
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
                out.print(f"  {problem}", markup=False, highlight=False)
    if not all(row["clear"] for row in rows):
        raise typer.Exit(EXIT_UNREACHABLE)


@app.command()
def serve(config: ConfigOption = Path("cluster.toml")) -> None:
    """Serve the nightly, after-reboot and manual deployments from this process (no work pool)."""
    cluster = _load(config)  # fail early, in plain words, on a bad configuration
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from deployments.definitions import serve_deployments

    serve_deployments(cluster, config)


@app.command()
def webhook(
    config: ConfigOption = Path("cluster.toml"),
    host: Annotated[str | None, typer.Option(help="Bind address (default webhook.host)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default webhook.port)")] = None,
) -> None:
    """Run the reboot webhook: signed calls from the nodes become Prefect events."""
    cluster = _load(config)
    from deployments.webhook import serve_webhook

    try:
        serve_webhook(cluster, host, port)
    except ValueError as exc:
        err.print(str(exc), markup=False, highlight=False)
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
            out.print(line, markup=False, highlight=False)
    except ValueError as exc:
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG) from None
    except RemoteError as exc:
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None


def main() -> None:
    app()
