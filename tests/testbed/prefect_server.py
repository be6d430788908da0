"""A Prefect server of a test's own, stoppable and startable again on the same port and
database: the controller's bad minutes (an outage, a restart) played for real."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tests.testbed.procs import free_port, spawn, stop, wait_until

BIN = Path(sys.executable).parent
# Where the shipped units keep the server's leases (deployments/systemd): through a restart.
FILE_LEASES = {
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": (
        "prefect.server.concurrency.lease_storage.filesystem"
    )
}


class PrefectServer:
    """`prefect server start` on loopback with its own home (SQLite; by default the in-memory
    lease storage, what an operator gets who starts Prefect by hand; ``env`` adds settings)."""

    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = env or {}
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.home / f"server-{self.starts}.log"
        env = {
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_URL": "",
            **self.env,
        }
        argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
        self.proc = spawn([*argv, "--port", str(self.port)], log, env)
        wait_until(self._healthy, 90, "prefect server", log)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace=15)
            self.proc = None

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def post(self, path: str, body: Any) -> Any:
        return self._ask("POST", path, body)

    def get(self, path: str) -> Any:
        return self._ask("GET", path)

    def _ask(self, method: str, path: str, body: Any = None) -> Any:
        """The answer's JSON; a 503 (SQLite busy under load) is asked again for up to 30 s."""
        deadline = time.monotonic() + 30
        while True:
            response = httpx.request(method, f"{self.url}{path}", json=body, timeout=30)
            if response.status_code != 503 or time.monotonic() > deadline:
                response.raise_for_status()
                return response.json()
            time.sleep(0.5)


def cli(command: str, path: Path, url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {"PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return spawn([str(BIN / "vllm-redeploy"), command, "--config", str(path)], log, env)


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def step_started(server: PrefectServer, flow_run_id: str, step: str) -> float | None:
    """When the run logged ``step STEP`` (the flow logs it as each step starts)."""
    logs = server.post(
        "/logs/filter",
        {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200},
    )
    found = [at(x["timestamp"]) for x in logs if x["message"] == f"step {step}"]
    return found[0] if found else None
