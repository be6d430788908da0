"""The quick loop (`pytest -m "not integration"`) starts nothing: every test that starts a Prefect
server, sshd, dockerd, PostgreSQL or a bed, itself or through a fixture, carries `integration`.

What starts a server is read from the tests' source (a call of a starter, or of a function of the
same module that calls one); which fixtures each test uses, and its marks, from pytest's own
collection, so a fixture that needs another fixture that starts a server counts too."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MARK_AUDIT

TESTS = Path(__file__).resolve().parent
# Calls that start a server (tests/testbed, tests/conftest.py).
STARTERS = {"make_bed", "TestBed.up", "SSHServer", "DockerEngine", "PostgresServer"}
# The session's servers (tests/conftest.py); fixtures that need them are found by pytest.
SERVER_FIXTURES = {"dockerd", "sshd", "prefect_server"}


def called(function: ast.AST) -> set[str]:
    """Names a function calls (``f``, ``A.f``), and "prefect server start" when it runs one."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                names.add(node.func.attr)
                if isinstance(node.func.value, ast.Name):
                    names.add(f"{node.func.value.id}.{node.func.attr}")
        elif isinstance(node, ast.List):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if any(words[i : i + 2] == ["server", "start"] for i in range(len(words))):
                names.add("prefect server start")
    return names


def starting_functions(path: Path) -> set[str]:
    """The module's functions (tests, fixtures, helpers) that start a server, directly or
    through another function of the module."""
    tree = ast.parse(path.read_text(), str(path))
    functions = {
        node.name: called(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    starting = {"prefect server start"} | STARTERS
    while True:
        more = {name for name, calls in functions.items() if calls & starting} - starting
        if not more:
            return starting & set(functions)
        starting |= more


def collected(config: pytest.Config) -> list[dict[str, Any]]:
    """Every test of the suite: this session's own collection when it holds every module (the
    quick loop, the full run), else a collection of its own."""
    mine = config.stash.get(MARK_AUDIT, [])
    if {item["module"] for item in mine} >= {path.name for path in TESTS.glob("test_*.py")}:
        return mine
    audit = TESTS / "output" / "mark_audit.json"
    audit.parent.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0"]
    done = subprocess.run(
        [*argv, "-p", "no:cacheprovider"],
        cwd=TESTS.parent,
        env={**os.environ, "VRD_MARK_AUDIT": str(audit)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(audit.read_text())


def test_every_test_that_starts_a_server_is_marked_integration(
    pytestconfig: pytest.Config,
) -> None:
    shared = starting_functions(TESTS / "conftest.py") | SERVER_FIXTURES
    here = Path(__file__).name  # reads the words it looks for; starts nothing
    starting = {p.name: starting_functions(p) for p in TESTS.glob("test_*.py") if p.name != here}
    unmarked = []
    items = collected(pytestconfig)
    for item in items:
        if item["integration"]:
            continue
        own = starting.get(item["module"], set())
        why = sorted(set(item["fixtures"]) & (shared | own))
        if item["function"] in own:
            why.append("starts it in its body")
        if why:
            unmarked.append(f"{item['nodeid']}: {', '.join(why)}")
    assert unmarked == [], "add pytest.mark.integration:\n" + "\n".join(unmarked)
    # The check saw the suite: its servers' users are there, and marked.
    users = [i for i in items if set(i["fixtures"]) & SERVER_FIXTURES]
    assert len(users) > 100 and all(i["integration"] for i in users)


def test_the_reader_finds_what_starts_a_server() -> None:
    """A reader that found nothing would pass for ever: it must see the known starters."""
    assert {"make_bed", "prefect_server", "dockerd", "sshd"} <= starting_functions(
        TESTS / "conftest.py"
    )
    assert "flow_bed" in starting_functions(TESTS / "test_flow.py")
    assert "start_server" in starting_functions(TESTS / "test_scale_out.py")
