"""The ``Run`` every task receives, as Prefect sees it when it creates a task run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.utilities.collections import visit_collection

from tasks.context import Run
from tests.test_config import MINIMAL, write
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes import NodeAccess


def test_prefect_never_walks_the_open_connections(tmp_path: Path) -> None:
    """Prefect walks every task's inputs (dataclass fields, dicts) as it creates the task run,
    while the run's other tasks open their nodes' connections on their own threads: on 8 nodes
    the walk once met the table as it grew and preflight failed with "dictionary changed size
    during iteration". The table must stay out of what Prefect walks."""
    text = MINIMAL.replace("10.0.0.1", "127.0.0.1").replace("10.0.0.2", "127.0.0.2")
    run = Run(load_config(write(tmp_path, text), env_file=None))
    opened = run.node("a")  # built, not connected
    seen: list[Any] = []

    def visit(expr: Any) -> Any:
        seen.append(expr)
        return expr

    visit_collection(run, visit, return_data=False)
    assert run in seen  # the walk did look at the run itself
    assert all(not isinstance(value, NodeAccess) for value in seen)
    assert all(not (isinstance(value, dict) and opened in value.values()) for value in seen)
    assert run.node("a") is opened  # one connection per node, reused
