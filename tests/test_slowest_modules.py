"""scripts/slowest_modules.py: the CI log's table of where the suite's time went."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slowest_modules.py"

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_flow" name="test_a" time="30.5" />
<testcase classname="tests.test_flow" name="test_b[x]" time="12.0"><failure message="x"/></testcase>
<testcase classname="tests.test_config" name="test_c" time="0.25" />
<testcase classname="tests.test_faults.TestRows" name="test_d" time="100" />
<testcase classname="tests.test_faults" name="test_e" time="1.0"><error message="y"/></testcase>
</testsuite></testsuites>
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=30
    )


def test_modules_are_summed_and_ordered_slowest_first(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(REPORT)
    done = run(str(report), "--top", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("slowest 2 of 3 test modules (2.4 min of test time")
    rows = [line.split() for line in lines[2:]]
    assert rows == [["101.0", "2", "1", "tests.test_faults"], ["42.5", "2", "1", "tests.test_flow"]]


def test_a_missing_or_broken_report_is_named(tmp_path: Path) -> None:
    missing = run(str(tmp_path / "none.xml"))
    assert missing.returncode == 1 and "no report at" in missing.stderr
    broken = tmp_path / "broken.xml"
    broken.write_text("<testsuites>")
    done = run(str(broken))
    assert done.returncode == 1 and "is not junit XML" in done.stderr
