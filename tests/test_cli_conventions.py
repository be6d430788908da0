"""What people type by habit: -h beside --help, --version with Prefect's version."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
import typer.main as typer_main
from typer.testing import CliRunner

from deployments.cli import app
from deployments.cli.common import EXIT_CONFIG


@pytest.mark.parametrize("args", [["-h"], ["run", "-h"], ["status", "-h"]])
def test_dash_h_is_help(args: list[str]) -> None:
    done = CliRunner().invoke(app, args, prog_name="vllm-redeploy")
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "Usage: vllm-redeploy" in text and "Show this message and exit." in text


def test_version_names_ours_and_prefects() -> None:
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0, done.output
    expected = f"vllm-redeploy {version('vllm-redeploy')} (Prefect {version('prefect')})"
    assert done.output.strip() == expected


def _commands() -> list[str]:
    group = typer_main.get_command(app)
    return group.list_commands(typer.Context(group))  # type: ignore[attr-defined]


def test_help_shows_flags_as_flags_and_values_by_what_they_are() -> None:
    """Typer shows a type for every option (`--dry-run <bool>`, `--reason <str>`): a flag is shown
    bare, a value by what it is (URL, NAME, DURATION), a choice by its choices."""
    for args in [[], *([name] for name in _commands())]:
        done = CliRunner().invoke(
            app, [*args, "--help"], prog_name="vllm-redeploy", terminal_width=200
        )
        assert done.exit_code == 0, (args, done.output)
        shown = set(re.findall(r"<[a-z_|.]+>", done.output))
        assert not shown & {"<bool>", "<str>", "<text>"}, (args, shown)
    run_help = CliRunner().invoke(app, ["run", "-h"], terminal_width=200).output
    assert "<redeploy|ensure>" in run_help
    pause_help = CliRunner().invoke(app, ["pause", "-h"], terminal_width=200).output
    assert re.search(r"--for\s+DURATION", pause_help), pause_help


def test_help_groups_the_commands_by_use_with_run_first() -> None:
    text = CliRunner().invoke(app, ["-h"], terminal_width=200).output
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels == [
        "Options",
        "Everyday",
        "Checks",
        "Set up",
        "Services (run by the installed units)",
    ]
    listed = re.findall(r"^│ ([a-z][a-z-]+) ", text, re.M)
    assert listed[0] == "run" and sorted(listed) == sorted(_commands()), listed
    group = typer_main.get_command(app)
    probe = group.get_command(typer.Context(group), "probe")  # type: ignore[attr-defined]
    assert probe.short_help.endswith("Exit 0 iff the model answers healthily.")  # one paragraph


def test_a_bad_choice_is_a_usage_error() -> None:
    done = CliRunner().invoke(app, ["run", "--mode", "fast", "-c", "/nonexistent.toml"])
    assert done.exit_code == EXIT_CONFIG == 2
    assert "'fast' is not one of 'redeploy'," in done.output, done.output


def test_the_readme_and_the_command_reference_name_every_command() -> None:
    """README's table of commands by use lists each command once; docs/commands.md gives each
    its row (a command added without its words fails here)."""
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    table = readme[readme.index("| use | commands |") :].split("\n\n", 1)[0]
    listed = re.findall(r"`([a-z][a-z-]+)`", table)
    assert sorted(listed) == sorted(_commands()), listed
    reference = (root / "docs/commands.md").read_text()
    missing = [c for c in _commands() if not re.search(rf"`(vllm-redeploy )?{c}\b", reference)]
    assert missing == [], missing
