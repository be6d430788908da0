"""Commands that look at a cluster and change nothing: check-config, nodes, fabric, probe,
check-gpus.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from deployments.cli.common import (
    CHECKS,
    EXIT_CONFIG,
    EXIT_FAILED,
    SETUP,
    ConfigOption,
    JsonOption,
    app,
    err,
    load_or_exit,
    markup_safe,
    out,
)
from vllm_redeploy import nccl_logging
from vllm_redeploy.config import (
    DEFAULT_CONFIG,
    SECRET_KEYS,
    ClusterConfig,
    NodeConfig,
    describe,
    settings_data,
)
from vllm_redeploy.config.launch import API_KEY_SECRET
from vllm_redeploy.config.toml_text import is_header, toml_document
from vllm_redeploy.endpoint import api_base, api_key
from vllm_redeploy.gpus import GpuReport, inspect_gpus
from vllm_redeploy.launch import planned_words
from vllm_redeploy.nodes import NodeAccess, check_nodes, fan_out
from vllm_redeploy.probe import run_probe
from vllm_redeploy.safe_text import for_terminal, shown

EXAMPLE = "cluster.example.toml"  # shipped in the deployments package


@app.command(rich_help_panel=SETUP)
def init(
    config: Annotated[Path, typer.Argument(help="Where to write it.")] = DEFAULT_CONFIG,
) -> None:
    """Write the example configuration (two DGX Sparks, every key explained) to start from."""
    if config.exists():
        err.print(
            f"{markup_safe(config)} exists: nothing was written. Edit it, or name another "
            "path (`vllm-redeploy init PATH`)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_CONFIG)
    example = files("deployments").joinpath(EXAMPLE).read_text(encoding="utf-8")
    config.write_text(example, encoding="utf-8")
    out.print(
        f"wrote {markup_safe(config)}: put your nodes' addresses, fabric IPs, image and model "
        f"in it, then run `vllm-redeploy check-config -c {markup_safe(config)}`",
        highlight=False,
        soft_wrap=True,
    )


@app.command("check-config", rich_help_panel=CHECKS)
def check_config(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Validate the configuration and print it resolved (secrets masked)."""
    cluster = load_or_exit(config)
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
    for line in settings_toml(cluster):
        style = "bold" if is_header(line) else None
        out.print(line, style=style, highlight=False, markup=False, soft_wrap=True)
    for note in nccl_logging.notes(cluster.vllm.env):
        out.print(f"[yellow]warning:[/] {markup_safe(note)}", highlight=False, soft_wrap=True)
    out.print("[green]configuration OK[/]")


def settings_toml(cluster: ClusterConfig) -> list[str]:
    """Every key of every section, resolved, as TOML that can be pasted into a configuration
    file (secrets masked, as comments); the sections are the model's, so a new one shows up."""
    derived = (
        f"# head: {cluster.head.name}; served model name: {cluster.vllm.served_name}; "
        f"weights loader: {planned_words(cluster)}"
    )
    secrets = frozenset(SECRET_KEYS)
    return [
        "# the resolved configuration (TOML; secrets masked):",
        for_terminal(derived),
        *toml_document(settings_data(cluster), secrets),
        "",
    ]


@app.command(rich_help_panel=CHECKS)
def nodes(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Contact every node in parallel: reachable, SSH round trip, Docker version."""
    cluster = load_or_exit(config)
    reports = check_nodes(cluster)
    if as_json:
        out.print_json(json.dumps([asdict(r) for r in reports]))
    else:
        table = Table(title=f"cluster {cluster.name}")
        for column in ("node", "address", "reachable", "round trip", "docker", "fabric", "problem"):
            table.add_column(column, overflow="fold")
        for r in reports:
            table.add_row(
                r.name,
                r.address if r.transport == "ssh" else "local",
                "[green]yes[/]" if r.reachable else "[red]no[/]",
                f"{r.rtt_ms:.1f} ms" if r.rtt_ms is not None else "-",
                markup_safe(r.docker_version or "-"),
                _fabric_cell(r.fabric),
                markup_safe(
                    "; ".join(filter(None, [r.error, *(r.fabric or {}).get("problems", [])]))
                ),
            )
        out.print(table)
    if not all(r.reachable and r.docker_version for r in reports):
        raise typer.Exit(EXIT_FAILED)


def _fabric_cell(fabric: dict[str, Any] | None) -> str:
    if fabric is None:
        return "-"
    where = f"{fabric['interface'] or 'no interface'} (MTU {fabric['mtu'] or '?'})"
    if fabric["twins"]:
        where += f" + {', '.join(fabric['twins'])}"
    hcas = []
    for h in fabric["hcas"]:
        state = (
            "[green]ACTIVE[/]" if h["state"] == "ACTIVE" else f"[red]{markup_safe(h['state'])}[/]"
        )
        hcas.append(f"{markup_safe(h['name'])}:{h['port']} {state}")
    return markup_safe(where) + "\n" + ("\n".join(hcas) if hcas else "no RDMA HCA")


@app.command(rich_help_panel=CHECKS)
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
            out.print(f"HCAs: {markup_safe(', '.join(verdict.hcas))}", highlight=False)
        for rank in verdict.ranks:
            network = rank.network or "no choice logged"
            line = f"  {rank.identity}: {network}"
            if rank.hcas:
                line += f" over {', '.join(rank.hcas)}"
            out.print(for_terminal(line), markup=False, highlight=False)
    if verdict.transport != "rdma":
        raise typer.Exit(EXIT_FAILED)


@app.command(rich_help_panel=CHECKS)
def probe(
    config: ConfigOption = Path("cluster.toml"),
    url: Annotated[
        str | None, typer.Option(metavar="URL", help="Base URL, e.g. http://head:30000")
    ] = None,
    model: Annotated[str | None, typer.Option(metavar="NAME", help="Served model name")] = None,
    max_tokens: Annotated[int | None, typer.Option(metavar="N", help="Token budget")] = None,
    as_json: JsonOption = False,
) -> None:
    """Send the reasoning-aware sanity probe (with vLLM's API key when one is set: the
    configuration's, or VLLM_REDEPLOY_SECRETS__VLLM_API_KEY with --url and --model). Exit 0 iff
    the model answers healthily."""
    key = os.environ.get(API_KEY_SECRET) or None
    if url and model:
        prompt, tokens, temperature, timeout = "Say hello in one sentence.", 50, 0.0, 60.0
    else:
        cluster = load_or_exit(config)
        url = url or api_base(cluster)
        model = model or cluster.vllm.served_name
        p = cluster.probe
        prompt, tokens, temperature, timeout = p.prompt, p.max_tokens, p.temperature, p.timeout_s
        key = api_key(cluster)
    verdict = run_probe(url, model, prompt, max_tokens or tokens, temperature, timeout, key)
    if as_json:
        out.print_json(json.dumps(verdict.as_dict()))
    else:
        colour = "green" if verdict.healthy else "red"
        state = "healthy" if verdict.healthy else "unhealthy"
        out.print(f"[{colour}]{state}[/]: ", end="", highlight=False)
        out.print(for_terminal(verdict.detail), markup=False, highlight=False)
    if not verdict.healthy:
        raise typer.Exit(EXIT_FAILED)


@app.command("check-gpus", rich_help_panel=CHECKS)
def check_gpus(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """Are the GPUs of every node free? Exit 0 iff all are clear."""
    cluster = load_or_exit(config)

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
                    "name": o.node,
                    "reachable": True,
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
                {
                    "name": o.node,
                    "reachable": False,
                    "clear": False,
                    "problems": [str(o.error)],
                    "processes": [],
                }
            )
    if as_json:
        out.print_json(json.dumps(rows))
    else:
        for row in rows:
            state = "[green]clear[/]" if row["clear"] else "[red]busy[/]"
            if not row["reachable"]:
                state = "[red]unreachable[/] (its GPUs not checked)"
            out.print(f"{row['name']}: {state}", highlight=False)
            for problem in row["problems"]:
                out.print(f"  {for_terminal(problem)}", markup=False, highlight=False)
    if not all(row["clear"] for row in rows):
        raise typer.Exit(EXIT_FAILED)
