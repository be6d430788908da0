"""Writing a benchmark's results: a markdown file under bench/results, echoed to the terminal."""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, lines: list[str], out: Path = RESULTS) -> Path:
    """Write ``lines`` and the command that produced them to <out>/<name>.md (default
    bench/results)."""
    command = " ".join([".venv/bin/python -m", f"bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]])
    text = "\n".join([*lines, "", f"Command: `{command}`", ""])
    path = out / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return path
