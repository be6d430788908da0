"""The documentation renders as written: every line that starts a table row is in a table (a
blank line inside a table, or a row left after a paragraph, shows the reader raw pipes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_table_row_renders_in_a_table(doc: Path) -> None:
    text = doc.read_text()
    tables: set[int] = set()
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        if token.type == "table_open" and token.map:
            tables.update(range(*token.map))
    fenced = False
    stray = []
    for number, line in enumerate(text.split("\n")):
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("|") and not fenced and number not in tables:
            stray.append(f"{doc.name}:{number + 1}: {line[:60]}")
    assert not stray, stray
