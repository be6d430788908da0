"""Where in a TOML file a key is written: its line number, for messages.

``tomllib`` keeps no positions, so the file's text is scanned: ``[table]`` and ``[[array]]``
headers, ``key =`` and ``dotted.key =`` lines, skipping multi-line strings. A line is only
named when it surely holds the key (its value, parsed on its own, is the value the file gives
that key); anything unusual (quoted keys, a key split over lines) names no line rather than a
wrong one.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from typing import Any

Path = tuple[str | int, ...]

_PART = r"[A-Za-z0-9_-]+"
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
_TABLE = re.compile(rf"^\s*\[\s*({_DOTTED})\s*\]\s*(?:#.*)?$")
_ARRAY = re.compile(rf"^\s*\[\[\s*({_DOTTED})\s*\]\]\s*(?:#.*)?$")
_KEY = re.compile(rf"^\s*({_DOTTED})\s*=\s*(.*)$")
_MULTILINE_QUOTES = ('"""', "'''")


def key_line(text: str, data: dict[str, Any], path: Path) -> int | None:
    """The 1-based line that sets ``path`` (or the table or key that holds it), or None."""
    lines = dict(_mapped_lines(text))
    for length in range(len(path), 0, -1):
        prefix = path[:length]
        if prefix not in lines:
            continue
        number, source = lines[prefix]
        return number if _surely_sets(source, data, prefix) else None
    return None


def _mapped_lines(text: str) -> Iterator[tuple[Path, tuple[int, str]]]:
    """(key path, (line number, line)) for each header and key line, first one of a path only."""
    table: Path | None = ()
    arrays: dict[Path, int] = {}
    seen: set[Path] = set()
    for number, line in _lines_outside_strings(text):
        found: Path | None = None
        if match := _ARRAY.match(line):
            table = found = _array_element(_parts(match.group(1)), arrays)
        elif match := _TABLE.match(line):
            table = found = _resolved(_parts(match.group(1)), arrays)
        elif line.lstrip().startswith("["):
            table = None  # a header this scan does not read (quoted keys): its keys go unnamed
        elif (match := _KEY.match(line)) and table is not None:
            found = table + _parts(match.group(1))
        if found is not None and found not in seen:
            seen.add(found)
            yield found, (number, line)


def _lines_outside_strings(text: str) -> Iterator[tuple[int, str]]:
    """Numbered lines, without those inside a multi-line string (where anything may stand)."""
    open_quote: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if open_quote is None:
            yield number, line
            opened = [q for q in _MULTILINE_QUOTES if line.count(q) % 2 == 1]
            open_quote = opened[0] if len(opened) == 1 else None
            if len(opened) > 1:  # both kinds unbalanced: too odd to follow
                return
        elif line.count(open_quote) % 2 == 1:
            open_quote = None


def _parts(dotted: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in dotted.split("."))


def _resolved(parts: tuple[str, ...], arrays: dict[Path, int]) -> Path:
    """A header's path, with the index of the latest element of each array of tables in it."""
    path: Path = ()
    for part in parts:
        path += (part,)
        if path in arrays:
            path += (arrays[path],)
    return path


def _array_element(parts: tuple[str, ...], arrays: dict[Path, int]) -> Path:
    array = (*_resolved(parts[:-1], arrays), parts[-1])
    arrays[array] = arrays.get(array, -1) + 1
    return (*array, arrays[array])


def _surely_sets(line: str, data: dict[str, Any], path: Path) -> bool:
    """A header line is trusted; a key line when its value, parsed alone, is the file's value
    (or, spread over several lines, starts the array or string the file has there)."""
    match = _KEY.match(line)
    if match is None:
        return True
    value = value_at(data, path)
    try:
        parsed = tomllib.loads(f"v = {match.group(2)}")["v"]
    except tomllib.TOMLDecodeError:
        rest = match.group(2).lstrip()
        return (isinstance(value, list) and rest.startswith("[")) or (
            isinstance(value, str) and rest.startswith(_MULTILINE_QUOTES)
        )
    return parsed == value


MISSING = object()


def value_at(data: Any, path: Path) -> Any:
    """The value at ``path`` in nested tables and lists, or MISSING."""
    for part in path:
        data = _step(data, part)
        if data is MISSING:
            break
    return data


def _step(data: Any, part: str | int) -> Any:
    if isinstance(part, int) and isinstance(data, list) and 0 <= part < len(data):
        return data[part]
    if isinstance(part, str) and isinstance(data, dict) and part in data:
        return data[part]
    return MISSING
