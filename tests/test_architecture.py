"""The floors of the product: what may import what (docs/architecture.md). A lower floor never
imports a higher one; the core (vllm_redeploy/) knows nothing of Prefect."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazily)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = sorted(name for name in imports_of(path) if name.split(".")[0] in forbidden)
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_core_imports_no_prefect_flows_tasks_or_deployments() -> None:
    assert offenders("vllm_redeploy", ("prefect", "flows", "tasks", "deployments")) == {}


@pytest.mark.parametrize("package", ["vllm_redeploy", "tasks", "flows", "deployments"])
def test_the_checker_sees_every_module(package: str) -> None:
    """A check that found no file would pass for ever."""
    assert any(imports_of(p) for p in (ROOT / package).rglob("*.py"))
