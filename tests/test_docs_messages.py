"""Every message a run can end with has its row in docs/troubleshooting.md: for each
``StepFailed(step, message)`` in the flow and its steps, the first words of the message's first
fixed piece are found there (what a person pastes into a search). A message is a literal or an
f-string, pieces joined with ``+``, or a helper's words: what a function it calls returns (one
call deep, in its module or the one it is imported from); and each line preflight adds to its
``problems``. Deeper helpers' words are checked where their own tests quote them."""

from __future__ import annotations

import ast
import importlib.util
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


def _strings(expr: ast.expr, path: Path, hops: int = 1) -> list[ast.expr]:
    """The literals and f-strings ``expr`` is made of; through a call, what the called function
    returns (``hops`` calls deep)."""
    if isinstance(expr, ast.JoinedStr) or (
        isinstance(expr, ast.Constant) and isinstance(expr.value, str)
    ):
        return [expr]
    if isinstance(expr, ast.BinOp):
        return _strings(expr.left, path, hops) + _strings(expr.right, path, hops)
    if isinstance(expr, ast.IfExp):
        return _strings(expr.body, path, hops) + _strings(expr.orelse, path, hops)
    if isinstance(expr, ast.Call) and hops > 0:
        func = expr.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        found = _function(path, name) if name else None
        if found is not None:
            where, function = found
            returned = [r.value for r in ast.walk(function) if isinstance(r, ast.Return)]
            return [s for r in returned if r is not None for s in _strings(r, where, hops - 1)]
    return []


def _function(path: Path, name: str) -> tuple[Path, ast.FunctionDef] | None:
    """The function ``name`` as ``path`` sees it: its own, or imported by name from a module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return path, node
    for node in ast.walk(tree):
        imported = isinstance(node, ast.ImportFrom) and node.module is not None
        if imported and name in (a.name for a in node.names):  # type: ignore[union-attr]
            spec = importlib.util.find_spec(node.module)
            if spec is not None and spec.origin is not None:
                return _function(Path(spec.origin), name)
    return None


def _said(node: ast.AST, path: Path) -> list[ast.expr]:
    """The messages ``node`` ends a run with: a StepFailed's, or a line added to problems."""
    if not isinstance(node, ast.Call):
        return []
    if getattr(node.func, "id", "") == "StepFailed" and len(node.args) >= 2:
        return _strings(node.args[1], path)
    func = node.func
    if (
        isinstance(func, ast.Attribute)
        and func.attr == "append"
        and getattr(func.value, "id", "") == "problems"
        and node.args
    ):
        return _strings(node.args[0], path, hops=0)
    return []


def messages() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            for message in _said(node, path):
                pieces = [p for p in fixed_pieces(message) if len(p) >= SHORTEST]
                if pieces:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"  # type: ignore[attr-defined]
                    found.append((where, pieces[0]))
    return found


def lookup(piece: str) -> str:
    """What the row must hold of a piece: its first words (a row may shorten the rest with …)."""
    words = " ".join(re.sub(r"[`*]", "", piece).split()).strip(" .;:()")
    return words[:LOOKUP].rsplit(" ", 1)[0] if len(words) > LOOKUP else words


def test_every_step_failure_has_its_row_in_troubleshooting() -> None:
    doc = " ".join(re.sub(r"[`*]", "", DOC.read_text()).split())
    found = messages()
    assert len(found) > 20  # the walk finds the flow's messages at all, the helpers' too
    missing = [f"{where}: {piece!r}" for where, piece in found if lookup(piece) not in doc]
    assert not missing, "no row in docs/troubleshooting.md for:\n" + "\n".join(missing)
