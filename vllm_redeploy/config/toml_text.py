"""Values and whole configurations written as TOML, the way a person would write them in the file:
for `check-config`'s output and for the fixes that error messages suggest.

Every string is a TOML basic string with its control and other unprintable characters escaped
(``\\u001b``), so what is printed can be pasted back and cannot act on a terminal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
TablePath = tuple[str, ...]


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string."""
    return '"' + "".join(_string_char(c) for c in text) + '"'


def _string_char(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if char.isprintable():
        return char
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    """A value as TOML writes it inline: ``30000``, ``true``, ``"16g"``, ``["--a", "1"]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _toml_float(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    return toml_string(str(value))


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def toml_document(
    data: Mapping[str, Any], secrets: frozenset[TablePath] = frozenset()
) -> list[str]:
    """``data`` as the lines of a TOML document: keys first, then ``[tables]`` and
    ``[[arrays of tables]]``. A key without a value (None) and a key in ``secrets`` (their
    values masked already) are written as comments, so the document can be pasted back."""
    return _table_body((), data, secrets)


def is_header(line: str) -> bool:
    return line.startswith("[")


def _table_body(
    path: TablePath, table: Mapping[str, Any], secrets: frozenset[TablePath]
) -> list[str]:
    lines = [
        _key_line((*path, key), value, secrets)
        for key, value in table.items()
        if not _is_table(value) and not _is_table_array(value)
    ]
    for key, value in table.items():
        inner = (*path, key)
        if _is_table(value):
            lines += ["", f"[{_dotted(inner)}]", *_table_body(inner, value, secrets)]
        elif _is_table_array(value):
            for item in value:
                lines += ["", f"[[{_dotted(inner)}]]", *_table_body(inner, item, secrets)]
    return lines


def _key_line(path: TablePath, value: Any, secrets: frozenset[TablePath]) -> str:
    key = toml_key(path[-1])
    if value is None:
        return f"# {key}: not set"
    if path in secrets:
        return f"# {key} = {toml_value(value)}  (a secret, masked: keep it in an env file)"
    return f"{key} = {toml_value(value)}"


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _dotted(path: TablePath) -> str:
    return ".".join(toml_key(part) for part in path)
