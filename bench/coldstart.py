"""The command line from a fresh process: `probe` against the served bed, and `run` with
Prefect's temporary API (no PREFECT_API_URL) or with the benchmark's real server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.prefect_server import PREFECT, QUIET

CLI = str(Path(sys.executable).parent / "vllm-redeploy")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return {**env, **QUIET, **extra}


def _timed(argv: list[str], env: dict[str, str], timeout: float) -> float:
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-2000:]}")
    return wall


def probe_s(config: Path) -> float:
    return _timed([CLI, "probe", "--config", str(config)], _env(), 120)


def prepare_temporary_home(home: Path) -> None:
    """A controller that has run Prefect before: its database exists (not timed)."""
    home.mkdir(parents=True, exist_ok=True)
    argv = [PREFECT, "server", "database", "upgrade", "-y"]
    subprocess.run(argv, env=_env(PREFECT_HOME=str(home)), capture_output=True, check=True)


def run_s(config: Path, api_url: str | None, temporary_home: Path) -> float:
    """`vllm-redeploy run` wall time; ``api_url`` None: Prefect's temporary API
    (``--temporary-api``)."""
    env = _env(PREFECT_HOME=str(temporary_home))
    argv = [CLI, "run", "--config", str(config)]
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        argv.append("--temporary-api")
    return _timed(argv, env, 600)
