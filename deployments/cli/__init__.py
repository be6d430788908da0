"""The command line: the composition root, above the flows, tasks and deployments it starts.

It lives here, not in vllm_redeploy/ (the Prefect-free core): its commands start flows, serve
deployments and read the cluster's standing from Prefect. Each command module registers its
commands on the one Typer app (common.py) when imported.
"""

import faulthandler
import os
import signal
from pathlib import Path

from deployments.cli import (
    cluster_commands,
    controller_commands,
    doctor_command,
    logs_command,
    run_view,
    runs_command,
    status_view,
    sync_command,
)
from deployments.cli.common import app

__all__ = [
    "app",
    "cluster_commands",
    "controller_commands",
    "doctor_command",
    "logs_command",
    "main",
    "run_view",
    "runs_command",
    "status_view",
    "sync_command",
]


def main() -> None:
    _leave_a_directory_it_cannot_search()
    # `kill -USR1 PID` prints where each thread of a command (a watcher, a run) waits, to stderr
    # (the journal under systemd), and the command goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    app()


def _leave_a_directory_it_cannot_search() -> None:
    """Run from a directory this user may not search (the services' user, `sudo -u`, in a
    person's home): Prefect's settings and ours look for a .env there and would fail on the
    permission. Nothing relative can be read from there anyway: work from the user's home."""
    if os.access(os.curdir, os.X_OK):
        return
    home = Path.home()
    os.chdir(home if os.access(home, os.X_OK) else "/")
