"""The command line: the composition root, above the flows, tasks and deployments it starts.

It lives here, not in vllm_redeploy/ (the Prefect-free core): its commands start flows, serve
deployments and read the cluster's standing from Prefect. Each command module registers its
commands on the one Typer app (common.py) when imported.
"""

from deployments.cli import (
    cluster_commands,
    controller_commands,
    run_view,
    status_view,
    sync_command,
)
from deployments.cli.common import app

__all__ = [
    "app",
    "cluster_commands",
    "controller_commands",
    "main",
    "run_view",
    "status_view",
    "sync_command",
]


def main() -> None:
    app()
