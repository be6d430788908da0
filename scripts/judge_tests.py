"""Run the suite, run its failed tests again alone, and judge the run on that second pass.

    python scripts/judge_tests.py [--output DIR] [--max-rerun N] -- .venv/bin/pytest [ARGS]

As CPython's test runner does: the first pass is the command as given (the whole suite on its
workers); the tests that failed in it, set-up and teardown errors included, run once more in a
fresh process with no other workers (pytest's own last-failed selection, `--lf -n 0`), in verbose
mode with their output in full. The run passes only if every one of them passes the second time.
A test that passed only the second time is a flake: the log ends with a block naming each one,
its first failure's last lines and its times, then the judgement; `flakes.txt` keeps one line per
flake (test id, tab, the first failure's message) and the junit report marks them as Maven
Surefire does (`flakyFailure`/`flakyError` in a passed test, `rerunFailure`/`rerunError` in one
that failed twice), so a junit reader shows them without failing the run.

A run that did not end in test failures (interrupted, a collection error, pytest's own error, no
tests collected) is judged as it ended: there is nothing to run again. Neither is one with more
failures than --max-rerun: that many at once are a broken change or a broken machine, not luck,
and running them again would cost another full run.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from slowest_modules import module_times, table

# pytest's exit codes (pytest.ExitCode), named here so the script needs no pytest import.
TESTS_FAILED = 1
NO_TESTS = 5
ENDINGS = {2: "was interrupted (a collection error?)", 3: "hit an internal error", 4: "was misused"}
LAST_LINES = 8
RULE = "=" * 24


@dataclass(frozen=True)
class Outcome:
    """One test's outcome in one pass, read from that pass's junit report."""

    failed: bool
    skipped: bool
    tag: str  # failure or error: how it first went wrong, if it did
    seconds: float
    message: str
    text: str


Key = tuple[str, str]  # (classname, name), as the junit report names a test


def outcomes(report: Path) -> dict[Key, Outcome]:
    """Every test of a junit report. A test may have several testcase elements (a teardown
    error after a failure): it failed if any of them holds a failure or an error."""
    found: dict[Key, Outcome] = {}
    # The report is pytest's own, written by this run: not untrusted input.
    for case in ET.parse(report).getroot().iter("testcase"):  # noqa: S314
        key = (case.get("classname", ""), case.get("name", ""))
        bad = [child for child in case if child.tag in ("failure", "error")]
        earlier = found.get(key)
        outcome = Outcome(
            failed=bool(bad) or (earlier is not None and earlier.failed),
            skipped=case.find("skipped") is not None,
            tag=bad[0].tag if bad else (earlier.tag if earlier else ""),
            seconds=float(case.get("time") or 0) + (earlier.seconds if earlier else 0),
            message=bad[0].get("message", "") if bad else (earlier.message if earlier else ""),
            text=(bad[0].text or "") if bad else (earlier.text if earlier else ""),
        )
        found[key] = outcome
    return found


def test_id(key: Key, root: Path) -> str:
    """pytest's node id for a junit name: the longest dotted prefix that is a file under root
    is the module (tests.test_x.TestRows -> tests/test_x.py::TestRows)."""
    classname, name = key
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def last_lines(text: str, count: int = LAST_LINES) -> list[str]:
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    return lines[-count:]


def first_line(message: str) -> str:
    line = (message.strip().splitlines() or ["(no message)"])[0]
    return line if len(line) <= 200 else line[:197] + "..."


def mark_junit(report: Path, flakes: set[Key], twice: dict[Key, Outcome]) -> None:
    """Rewrite the first pass's report: a flake's failures become flakyFailure/flakyError (the
    test counts as passed); a test that failed twice keeps them and gains the second pass's as
    rerunFailure/rerunError. The suites' failure and error counts follow."""
    tree = ET.parse(report)  # noqa: S314 (pytest's own report, as above)
    for suite in tree.getroot().iter("testsuite"):
        for case in suite.iter("testcase"):
            key = (case.get("classname", ""), case.get("name", ""))
            for child in case:
                if child.tag in ("failure", "error") and key in flakes:
                    child.tag = "flakyFailure" if child.tag == "failure" else "flakyError"
            if second := twice.pop(key, None):  # once per test, on its first testcase element
                tag = "rerunError" if second.tag == "error" else "rerunFailure"
                ET.SubElement(case, tag, message=second.message).text = second.text
        suite.set("failures", str(sum(1 for _ in suite.iter("failure"))))
        suite.set("errors", str(sum(1 for _ in suite.iter("error"))))
    tree.write(report, encoding="utf-8", xml_declaration=True)


def say(*lines: str) -> None:
    print(*lines, sep="\n", flush=True)


def judge(
    first: dict[Key, Outcome], second: dict[Key, Outcome]
) -> tuple[list[tuple[Key, Outcome, Outcome]], dict[Key, str]]:
    """The flakes (first and second outcome), and the tests that still fail, with why."""
    flakes: list[tuple[Key, Outcome, Outcome]] = []
    failing: dict[Key, str] = {}
    for key, outcome in first.items():
        if not outcome.failed:
            continue
        again = second.get(key)
        if again is None:
            failing[key] = "was not run the second time"
        elif again.failed:
            failing[key] = "failed again: " + first_line(again.message)
        elif again.skipped:
            failing[key] = "was skipped the second time, so it never passed"
        else:
            flakes.append((key, outcome, again))
    return flakes, failing


def flake_block(flakes: list[tuple[Key, Outcome, Outcome]], root: Path) -> list[str]:
    lines = [f"{RULE} flakes: {len(flakes)} (failed, then passed when run again alone) {RULE}"]
    for key, first, second in flakes:
        lines.append(
            f"{test_id(key, root)}  failed after {first.seconds:.1f} s, "
            f"passed alone in {second.seconds:.1f} s"
        )
        lines += [f"    {line}" for line in last_lines(first.text or first.message)]
    if not flakes:
        lines.append("(none)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tests/output"))
    parser.add_argument("--max-rerun", type=int, default=50)
    parser.add_argument("pytest", nargs=argparse.REMAINDER, help="-- then the pytest command")
    args = parser.parse_args(argv)
    command = args.pytest[1:] if args.pytest[:1] == ["--"] else args.pytest
    if not command:
        parser.error("give the pytest command after --, e.g. -- .venv/bin/pytest")
    root = Path.cwd()
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    report, rerun_report, flakes_file = (
        output / "junit.xml",
        output / "junit-rerun.xml",
        output / "flakes.txt",
    )
    # A cache of this run's own: --lf then selects exactly this run's failures, never an
    # earlier run's leftovers (a test deselected since still sits in the default cache).
    cache = output / "pytest-cache"
    shutil.rmtree(cache, ignore_errors=True)
    rerun_report.unlink(missing_ok=True)
    own = ["-o", f"cache_dir={cache}"]
    flakes_file.write_text("")

    code = subprocess.run([*command, *own, f"--junitxml={report}"], check=False).returncode
    if report.is_file():
        say("", table(module_times(report), 20))
    if code == NO_TESTS:
        say("judge: pytest collected no tests; a suite must never be empty")
        return 1
    if code not in (0, TESTS_FAILED) or not report.is_file():
        how = ENDINGS.get(code, "ended with no report" if code in (0, 1) else "was stopped")
        say(f"judge: the run {how} (exit code {code}): nothing to run again; judged failed")
        return code or 1
    first = outcomes(report)
    failed = [key for key, outcome in first.items() if outcome.failed]
    if code == TESTS_FAILED and not failed:
        say("judge: pytest exited 1 but its report names no failed test; judged failed")
        return 1
    if len(failed) > args.max_rerun:
        say(
            f"judge: {len(failed)} tests failed, more than --max-rerun {args.max_rerun}: "
            "too many to be flakes, so none runs again; judged failed"
        )
        return 1

    second: dict[Key, Outcome] = {}
    if failed:
        say(
            "",
            f"{RULE} running the {len(failed)} failed test(s) again, alone, in a fresh "
            f"process (--lf -n 0) {RULE}",
        )
        again = [
            *command,
            *own,
            "--lf",
            "--lfnf=none",
            "-n",
            "0",
            "-v",
            "--tb=long",
            "-rA",
            f"--junitxml={rerun_report}",
        ]
        subprocess.run(again, check=False)
        if rerun_report.is_file():
            second = outcomes(rerun_report)
    flakes, failing = judge(first, second)
    flakes.sort(key=lambda flake: test_id(flake[0], root))
    mark_junit(
        report,
        {key for key, _, _ in flakes},
        {key: second[key] for key in failing if key in second},
    )
    flakes_file.write_text(
        "".join(
            f"{test_id(key, root)}\t{first_line(outcome.message)}\n" for key, outcome, _ in flakes
        )
    )

    lines = ["", *flake_block(flakes, root)]
    for key, why in failing.items():
        lines.append(f"FAILED {test_id(key, root)}: {why}")
    passed = sum(1 for outcome in first.values() if not outcome.failed and not outcome.skipped)
    verdict = "FAILED" if failing else "passed"
    lines.append(
        f"{RULE} judged {verdict}: {len(failing)} failed twice, {len(flakes)} flake(s), "
        f"{passed} passed the first time (flakes listed in {flakes_file}) {RULE}"
    )
    say(*lines)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
