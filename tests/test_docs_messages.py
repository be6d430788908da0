"""Every message a run can end with has its row in docs/troubleshooting.md: for each
``StepFailed(step, <literal or f-string>)`` in the flow and its steps, the first words of the
message's first fixed piece are found there (what a person pastes into a search). Messages
built elsewhere (a helper's words) are checked where their own tests quote them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "troubleshooting.md"
SOURCES = [ROOT / "flows" / "redeploy.py", *sorted((ROOT / "tasks").rglob("*.py"))]
SHORTEST = 20  # a fixed piece shorter than this says too little to look for
LOOKUP = 40


def fixed_pieces(node: ast.expr) -> list[str]:
    """The constant parts of a literal or an f-string, whitespace made single spaces."""
    parts = node.values if isinstance(node, ast.JoinedStr) else [node]
    text = "".join(
        p.value if isinstance(p, ast.Constant) and isinstance(p.value, str) else "\0" for p in parts
    )
    return [" ".join(piece.split()) for piece in text.split("\0")]


def messages() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "StepFailed"):
                continue
            if len(node.args) < 2 or not isinstance(node.args[1], ast.JoinedStr | ast.Constant):
                continue
            pieces = [p for p in fixed_pieces(node.args[1]) if len(p) >= SHORTEST]
            if pieces:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found.append((where, pieces[0]))
    return found


def lookup(piece: str) -> str:
    """What the row must hold of a piece: its first words (a row may shorten the rest with …)."""
    words = " ".join(re.sub(r"[`*]", "", piece).split()).strip(" .;:()")
    return words[:LOOKUP].rsplit(" ", 1)[0] if len(words) > LOOKUP else words


def test_every_step_failure_has_its_row_in_troubleshooting() -> None:
    doc = " ".join(re.sub(r"[`*]", "", DOC.read_text()).split())
    found = messages()
    assert len(found) > 10  # the walk finds the flow's messages at all
    missing = [f"{where}: {piece!r}" for where, piece in found if lookup(piece) not in doc]
    assert not missing, "no row in docs/troubleshooting.md for:\n" + "\n".join(missing)
