"""The floors of the product: what may import what (docs/architecture.md). A lower floor never
imports a higher one; the core (vllm_redeploy/) knows nothing of Prefect."""

from __future__ import annotations

import ast
import re
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


# The floors, lowest first: each may import those below it, never those above.
FLOORS = [
    ("core", lambda m: m.startswith("vllm_redeploy")),
    ("standing", lambda m: m.startswith(("tasks.standing", "tasks.context", "tasks.records"))),
    ("steps", lambda m: m == "tasks" or m.startswith("tasks.")),
    ("flows", lambda m: m == "flows" or m.startswith("flows.")),
    ("deployments", lambda m: m.startswith("deployments") and not m.startswith("deployments.cli")),
    ("command line", lambda m: m.startswith("deployments.cli")),
]


def floor(module: str) -> int | None:
    return next((i for i, (_, is_on) in enumerate(FLOORS) if is_on(module)), None)


def test_no_import_runs_upward() -> None:
    upward = []
    for package in ("vllm_redeploy", "tasks", "flows", "deployments"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            here = floor(module.removesuffix(".__init__"))
            for name in imports_of(path):
                there = floor(name)
                if here is not None and there is not None and there > here:
                    upward.append(
                        f"{module} ({FLOORS[here][0]}) imports {name} ({FLOORS[there][0]})"
                    )
    assert upward == []


@pytest.mark.parametrize("package", ["vllm_redeploy", "tasks", "flows", "deployments"])
def test_the_checker_sees_every_module(package: str) -> None:
    """A check that found no file would pass for ever."""
    assert any(imports_of(p) for p in (ROOT / package).rglob("*.py"))


def test_steps_tell_prefect_through_the_runs_records() -> None:
    """Artifacts and events go through ``run.records`` (tasks/records.py): a direct call would
    hold a step up while the Prefect API is away, and fail the run when it answers 500."""
    direct = re.compile(r"\b(create_\w+_artifact|update_progress_artifact|emit_event)\(")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("tasks", "flows")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "records.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line) and "lambda" not in line and "def " not in line
    ]
    assert offenders == []


def modules_imported(path: Path) -> set[str]:
    """Every module a file imports, with ``from package import module`` as the module."""
    found = imports_of(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


LAUNCH = ROOT / "vllm_redeploy" / "launch"


def backend_modules() -> set[str]:
    """The backends' modules in launch/: each one that names its BACKEND, and its helpers
    (``ray_log``, ``ray_settle``: the backend's name, then ``_``)."""
    names = [
        p.stem
        for p in LAUNCH.glob("*.py")
        if re.search(r"^BACKEND = ", p.read_text(), re.MULTILINE)
    ]
    return {
        f"vllm_redeploy.launch.{p.stem}"
        for p in LAUNCH.glob("*.py")
        if any(p.stem == n or p.stem.startswith(f"{n}_") for n in names)
    }


def test_nothing_outside_launch_imports_a_backend() -> None:
    """A backend answers for itself (launch/backend.py); the rest asks the registry or the
    plan. Without this, a second `if backend == "ray"` would creep back in."""
    backends = backend_modules()
    # The check sees what it looks for: the registry imports both backends.
    assert {"vllm_redeploy.launch.ray", "vllm_redeploy.launch.mp"} <= backends
    assert {"vllm_redeploy.launch.ray", "vllm_redeploy.launch.mp"} <= modules_imported(
        LAUNCH / "choose.py"
    )
    outside = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in ("vllm_redeploy", "tasks", "flows", "deployments", "bench")
        for path in sorted((ROOT / package).rglob("*.py"))
        if LAUNCH not in path.parents
        for name in sorted(modules_imported(path) & backends)
    ]
    assert outside == []


def test_every_task_names_its_runs() -> None:
    """Without ``task_run_name`` Prefect names a run ``probe-0d3``: a hash suffix people cannot
    search for in the UI or the logs."""
    tasks = []
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                func = getattr(decorator, "func", None)
                if getattr(func, "id", None) == "task":
                    named = {k.arg for k in decorator.keywords}  # type: ignore[attr-defined]
                    tasks.append((f"{path.relative_to(ROOT)}:{node.name}", named))
    assert len(tasks) > 15  # the walk finds the steps' tasks at all
    assert [where for where, named in tasks if "task_run_name" not in named] == []
