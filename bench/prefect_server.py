"""One real `prefect server start` for a whole benchmark (its start-up is not measured)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.testbed.procs import free_port, spawn, stop, wait_until

PREFECT = str(Path(sys.executable).parent / "prefect")
QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_prefect_server(workdir: Path) -> Iterator[str]:
    """Start a server on loopback with its own PREFECT_HOME (SQLite); yield its API URL."""
    home = workdir / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    env = {
        **QUIET,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_URL": "",
    }
    log = workdir / "prefect-server.log"
    argv = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = spawn(argv, log, env)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_until(lambda: _healthy(url), 120, "prefect server", log)
        yield url
    finally:
        stop(proc, grace=15)


@contextlib.contextmanager
def using_api(url: str) -> Iterator[None]:
    """Point this process's Prefect client (flows run in-process) at ``url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield
    finally:
        if saved is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = saved
