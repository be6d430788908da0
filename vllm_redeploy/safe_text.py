"""Foreign text shown safely: values we did not write never add a line, move the cursor, change
colours or inject markup.

Foreign means anything from outside this program: the configuration and the environment, remote
nodes (container, unit and process names, log tails), HTTP bodies and webhook calls. Every place
that puts such a value into a message uses one of these:

- ``shown(value)``: a value inside a one-line message. Plain values stay as they are; a value with
  a control character, a line or paragraph separator or a bidi override is shown the way Python's
  ``repr`` writes it (quoted, ``\\n`` and ``\\x1b`` escaped), so it cannot pass for our own text.
- ``one_line(text)``: a whole line of foreign origin (a library's error message): every control
  character escaped in place, no quotes added.
- ``block(text)``: many foreign lines under a message (a log tail): terminal escape sequences
  removed, other controls escaped, and every line indented, so no line of it can pass for a line
  of ours in a log or a terminal.
- ``for_terminal(text)``: our own multi-line text that carries foreign values, right before it is
  printed: escape sequences removed, controls other than newline and tab escaped.
- ``fenced(text)``: a Markdown code block that no content can close (the fence is longer than any
  run of backticks inside).
"""

from __future__ import annotations

import re

# ECMA-48 sequences a terminal acts on: CSI (colours, cursor, clear screen), OSC (window title,
# hyperlinks; ended by BEL or ST), DCS/SOS/PM/APC strings, and two-character escapes. Their
# 8-bit C1 forms (\x9b for CSI, \x9d for OSC, ...) too.
_ESCAPES = re.compile(
    r"""
    (?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]                    # CSI ... final byte
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)  # OSC, DCS, SOS, PM, APC
    | \x1b[ -/]*[0-~]                                   # two-character (and nF) escapes
    """,
    re.VERBOSE | re.DOTALL,
)
BLOCK_INDENT = "    "


def _escaped(char: str) -> str:
    return repr(char)[1:-1]


def _plain(text: str) -> bool:
    return text.isprintable()


def shown(value: object) -> str:
    """``value`` for a one-line message: as it is when plain, else ``repr``-quoted."""
    text = str(value)
    return text if _plain(text) else repr(text)


def one_line(text: object) -> str:
    """``text`` on one line: every character that is not printable written as an escape."""
    text = str(text)
    if _plain(text):
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def strip_escapes(text: str) -> str:
    """``text`` without the terminal escape sequences in it."""
    return _ESCAPES.sub("", text)


def for_terminal(text: object) -> str:
    """``text`` safe to print: escape sequences removed, controls but newline and tab escaped.
    A carriage return alone (it would let a line overwrite the one before) is escaped too."""
    text = strip_escapes(str(text)).replace("\r\n", "\n")
    if all(c.isprintable() or c in "\n\t" for c in text):
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else _escaped(c) for c in text)


def block(text: object, indent: str = BLOCK_INDENT) -> str:
    """Foreign lines (a log tail) to put below a message: cleaned and indented line by line."""
    lines = for_terminal(text).strip("\n").split("\n")
    return "\n".join(indent + line.replace("\t", "    ") for line in lines)


def fenced(text: object, info: str = "") -> str:
    """``text`` as a Markdown code block whose fence no line of it can close."""
    body = for_terminal(text).strip("\n")
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{body}\n{fence}"
