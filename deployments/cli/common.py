"""What every command shares: the Typer app, the consoles, the options, and loading a
configuration with a one-paragraph error (exit 2) instead of a traceback.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperGroup, TyperOption

from vllm_redeploy.config import (
    CONFIG_VARIABLE,
    ClusterConfig,
    ConfigError,
    load_clusters,
    load_config,
    resolve_config,
)
from vllm_redeploy.config.runs import DEFAULT_NIGHTLY
from vllm_redeploy.launch.choose import backend_problem
from vllm_redeploy.safe_text import for_terminal, shown

# Exit codes, one per thing a script would do about it (README and docs/troubleshooting.md).
EXIT_FAILED = 1  # the operation ran and failed, or found the cluster unhealthy
EXIT_CONFIG = 2  # bad input (a flag, the configuration), like argparse and click
EXIT_CONTROLLER = 3  # the controller's Prefect API is not found, does not answer or refuses us

# The panels of --help, in this order; each command names its own.
EVERYDAY = "Everyday"
CHECKS = "Checks"
SETUP = "Set up"
SERVICES = "Services (run by the installed units)"
PANELS = (EVERYDAY, CHECKS, SETUP, SERVICES)
FIRST = ("run", "status", "logs", "runs", "stop", "pause", "resume")  # typed most, listed first


class Commands(TyperGroup):
    """The commands as people read them in --help: grouped by use, a flag shown as a flag (not
    as ``<bool>``), each command's help on one line in the list."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        def place(name: str) -> tuple[int, int]:
            named = getattr(self.commands[name], "rich_help_panel", None)
            panel = PANELS.index(named) if named in PANELS else len(PANELS)
            return panel, FIRST.index(name) if name in FIRST else len(FIRST)

        return sorted(super().list_commands(ctx), key=place)  # stable: else as registered

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _as_flags(command.get_params(ctx))
            if command.short_help is None and command.help:
                first = inspect.cleandoc(command.help).split("\n\n", 1)[0]
                command.short_help = " ".join(first.split())
        return command

    def get_params(self, ctx: typer.Context) -> Any:
        return _as_flags(super().get_params(ctx))


def _as_flags(params: list[Any]) -> list[Any]:
    """Typer shows a type beside every parameter (``--dry-run <bool>``, ``NODE <str>``): a flag
    gets none, and an argument none beside the name its metavar gives it."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
        elif isinstance(param, TyperArgument) and param.metavar is not None:
            param.display_type_rich = _no_type  # type: ignore[method-assign]
    return params


def _no_type(ctx: typer.Context) -> None:
    return None


app = typer.Typer(
    cls=Commands,
    help="Bring a multi-node vLLM server back by itself.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        typer.echo(f"vllm-redeploy {version('vllm-redeploy')} (Prefect {version('prefect')})")
        raise typer.Exit()


@app.callback()
def _options(
    _: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the versions and exit."
        ),
    ] = False,
) -> None:
    """Bring a multi-node vLLM server back by itself."""


# Piped output is not cut at 80 columns: it goes to logs and other programs.
out = Console(width=None if Console().is_terminal else 200)


err = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 200)


def _resolved(path: Path) -> Path:
    return resolve_config(path)


def _all_resolved(paths: list[Path]) -> list[Path]:
    return [resolve_config(p) for p in paths]


# Without --config the path comes from VLLM_REDEPLOY_CONFIG (prefect.yaml's, compose.yaml's),
# else ./cluster.toml, else the one cluster installed here. A name finds an installed cluster.
ConfigOption = Annotated[
    Path,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        help="Cluster configuration (TOML), or the name of a cluster installed by "
        "install-controller (/etc/vllm-redeploy/NAME.toml).",
        envvar=CONFIG_VARIABLE,
        show_default=True,
        callback=_resolved,
    ),
]


ConfigsOption = Annotated[
    list[Path],
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        help="A cluster's configuration (TOML) or installed cluster's name; repeat for several "
        f"(each with its own env file). {CONFIG_VARIABLE} may name several, separated by "
        f"'{os.pathsep}'.",
        envvar=CONFIG_VARIABLE,
        show_default=True,
        callback=_all_resolved,
    ),
]


CONFIGS_DEFAULT = [Path("cluster.toml")]


JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def duration_s(flag: str, text: str) -> float:
    """``2h``, ``30m``, ``90s``, ``1d`` or plain seconds; else exit 2 saying how to write it."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        err.print(
            f"{flag} {shown(text)}: give a number with s, m, h or d, e.g. 2h or 30m", markup=False
        )
        raise typer.Exit(EXIT_CONFIG)
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def markup_safe(value: object) -> str:
    """A foreign value inside our rich markup: no escape sequences, no markup of its own."""
    return escape(for_terminal(value))


def load_or_exit(path: Path) -> ClusterConfig:
    return load_all_or_exit([path])[0]


def load_all_or_exit(paths: list[Path]) -> list[ClusterConfig]:
    try:
        clusters = load_clusters(paths) if len(paths) > 1 else [load_config(paths[0])]
        for cluster, path in zip(clusters, paths, strict=False):
            if problem := backend_problem(cluster):
                raise ConfigError(str(path), [problem])
            if cluster.schedule.nightly not in ("off", DEFAULT_NIGHTLY):
                from deployments.definitions import schedule_problem

                if problem := schedule_problem(cluster):
                    raise ConfigError(str(path), [problem])
        return clusters
    except ConfigError as exc:
        err.print(
            f"[bold red]Configuration problem in {markup_safe(shown(exc.source))}[/]",
            highlight=False,
        )
        for problem in exc.problems:
            err.print(f"  - {for_terminal(problem)}", highlight=False, markup=False)
        err.print(
            "Fix the keys named above (see cluster.example.toml), then run "
            "`vllm-redeploy check-config` again.",
            highlight=False,
        )
        raise typer.Exit(EXIT_CONFIG) from None
