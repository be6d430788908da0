"""scripts/judge_tests.py: CI runs the suite's failed tests again alone and judges the run on
that, naming every flake. Each test here builds a throwaway project of its own in a temporary
directory and judges a real pytest run of it; nothing of it enters the real suite."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "judge_tests.py"

# Each test notes where it ran (an xdist worker's name, or "alone") in a file beside it.
RUNS = """
import os
from pathlib import Path

HERE = Path(__file__).parent


def ran(name: str) -> bool:
    '''Notes this run; True the first time.'''
    log = HERE / f"{name}.runs"
    first = not log.exists()
    with log.open("a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "alone") + "\\n")
    return first
"""

LUCK = """
from tests.runs import ran


def test_unlucky_once():
    assert not ran("unlucky"), "lost a race the first time"


def test_passes():
    ran("passes")
"""

BED = """
import pytest

from tests.runs import ran


@pytest.fixture(scope="module")
def bed():
    if ran("bed"):
        raise RuntimeError("the bed did not come up")
    return "up"


def test_one(bed):
    assert bed == "up"


def test_two(bed):
    assert bed == "up"
"""

BROKEN = """
def test_always_fails():
    assert 1 == 2, "broken for good"
"""


def project(tmp_path: Path, **modules: str) -> Path:
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "runs.py").write_text(RUNS)
    for name, source in modules.items():
        (root / "tests" / f"{name}.py").write_text(source)
    return root


def judge(root: Path, *pytest_args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), "--output", "out", "--", sys.executable, "-m"]
    return subprocess.run(
        [*command, "pytest", "-p", "xdist.plugin", *pytest_args],
        cwd=root,
        # Only xdist: the venv's other plugins (Hypothesis, anyio, ...) cost a second a start.
        # Nothing of this pytest's own (an xdist worker's name) reaches the project's runs.
        env={
            **{name: value for name, value in os.environ.items() if not name.startswith("PYTEST")},
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def runs(root: Path, name: str) -> list[str]:
    return (root / "tests" / f"{name}.runs").read_text().split()


def cases(report: Path) -> dict[str, list[str]]:
    """Test name -> the tags of what its testcase element holds."""
    tree = ET.parse(report)
    return {case.get("name", ""): [c.tag for c in case] for case in tree.getroot().iter("testcase")}


def test_a_flake_passes_the_run_and_a_test_failing_twice_fails_it(tmp_path: Path) -> None:
    root = project(tmp_path, test_luck=LUCK, test_bed=BED, test_broken=BROKEN)
    done = judge(root, "-n", "2")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr

    # Only the failed tests ran again (a module's set-up error takes down each of its tests),
    # in one fresh process of their own.
    assert len(runs(root, "passes")) == 1
    first, second = runs(root, "unlucky")
    assert first.startswith("gw") and second == "alone"
    assert runs(root, "bed")[1:] == ["alone"]
    assert "running the 4 failed test(s) again, alone" in out

    block = out[out.index("flakes: 3 (failed, then passed when run again alone)") :]
    for test in (
        "test_luck.py::test_unlucky_once",
        "test_bed.py::test_one",
        "test_bed.py::test_two",
    ):
        assert f"tests/{test}  failed after" in block
    assert "lost a race the first time" in block and "the bed did not come up" in block
    assert "FAILED tests/test_broken.py::test_always_fails: failed again: AssertionError" in block
    assert (
        block.rstrip()
        .splitlines()[-1]
        .startswith("======================== judged FAILED: 1 failed twice, 3 flake(s), 1 passed")
    )

    flakes = (root / "out" / "flakes.txt").read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in flakes) == [
        "tests/test_bed.py::test_one",
        "tests/test_bed.py::test_two",
        "tests/test_luck.py::test_unlucky_once",
    ]
    assert any("lost a race the first time" in line for line in flakes)

    report = root / "out" / "junit.xml"
    marked = cases(report)
    assert marked["test_unlucky_once"] == ["flakyFailure"]
    assert marked["test_one"] == ["flakyError"] and marked["test_two"] == ["flakyError"]
    assert marked["test_always_fails"] == ["failure", "rerunFailure"]
    assert marked["test_passes"] == []
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None and (suite.get("failures"), suite.get("errors")) == ("1", "0")


def test_a_run_whose_failures_all_pass_alone_passes_and_names_them(tmp_path: Path) -> None:
    root = project(tmp_path, test_luck=LUCK)
    done = judge(root, "-n", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    tail = done.stdout.rstrip().splitlines()
    assert "tests/test_luck.py::test_unlucky_once  failed after" in "\n".join(tail[-12:])
    assert "judged passed: 0 failed twice, 1 flake(s), 1 passed the first time" in tail[-1]


def test_a_clean_run_runs_nothing_again_and_says_so(tmp_path: Path) -> None:
    root = project(tmp_path, test_ok="def test_ok():\n    pass\n")
    (root / "out").mkdir()
    (root / "out" / "flakes.txt").write_text("tests/test_old.py::test_x\tfrom an earlier run\n")
    done = judge(root, "-n", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.rstrip().splitlines()
    assert lines[-3:-1] == [
        "======================== flakes: 0 (failed, then passed when run again alone) "
        "========================",
        "(none)",
    ]
    assert "judged passed: 0 failed twice, 0 flake(s), 1 passed" in lines[-1]
    assert "again, alone" not in done.stdout
    assert (root / "out" / "flakes.txt").read_text() == ""


def test_a_run_that_did_not_end_in_failures_is_judged_as_it_ended(tmp_path: Path) -> None:
    root = project(tmp_path, test_syntax="def test_x(:\n")
    done = judge(root, "-n", "0")
    assert done.returncode == 2
    assert (
        "judge: the run was interrupted (a collection error?) (exit code 2): nothing to run "
        "again; judged failed"
    ) in done.stdout
    (root / "tests" / "test_syntax.py").unlink()
    empty = judge(root, "-n", "0")
    assert empty.returncode == 1
    assert "pytest collected no tests; a suite must never be empty" in empty.stdout
