"""What people type by habit: -h beside --help, --version with Prefect's version."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from deployments.cli import app


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
