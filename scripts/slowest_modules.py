"""Where a test run's time went: the slowest test modules of a junit XML report.

    python scripts/slowest_modules.py tests/output/junit.xml [--top 20]

A module's time is the sum of its tests' (each with its setup and teardown, as pytest's junit
report counts them). Modules run whole on one xdist worker (`--dist loadfile`), so that sum is
about the module's wall time on its worker; the run's wall time is about the busiest worker's.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def module_times(report: Path) -> dict[str, tuple[float, int, int]]:
    """Module -> (seconds, tests, tests that failed or errored)."""
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, int] = defaultdict(int)
    failed: dict[str, int] = defaultdict(int)
    # The report is pytest's own, written by this run: not untrusted input.
    for case in ET.parse(report).getroot().iter("testcase"):  # noqa: S314
        module = case.get("classname", "?").split("::")[0]
        # classname is the dotted module, then any class: tests.test_flow or tests.test_x.Class
        module = ".".join(part for part in module.split(".") if not part[:1].isupper())
        seconds[module] += float(case.get("time") or 0)
        tests[module] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed[module] += 1
    return {m: (seconds[m], tests[m], failed[m]) for m in seconds}


def table(times: dict[str, tuple[float, int, int]], top: int) -> str:
    total = sum(s for s, _, _ in times.values())
    rows = sorted(times.items(), key=lambda item: item[1][0], reverse=True)[:top]
    lines = [
        f"slowest {len(rows)} of {len(times)} test modules ({total / 60:.1f} min of test time "
        "in all, over the workers)",
        f"{'seconds':>8}  {'tests':>5}  {'failed':>6}  module",
    ]
    lines += [f"{s:8.1f}  {n:5d}  {f or '':>6}  {m}" for m, (s, n, f) in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    if not args.report.is_file():
        print(f"slowest_modules: no report at {args.report} (did pytest run?)", file=sys.stderr)
        return 1
    try:
        times = module_times(args.report)
    except ET.ParseError as error:
        print(f"slowest_modules: {args.report} is not junit XML: {error}", file=sys.stderr)
        return 1
    print(table(times, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
