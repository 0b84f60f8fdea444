"""Text from calendars made inert before it is shown anywhere.

Anyone who can write to a calendar writes UIDs, titles, descriptions and file
names. Shown raw, such text can clear an admin's terminal (ESC sequences),
reorder what a line appears to say (U+202E and the other bidi controls),
start a new log line with a forged journald priority (a line break followed
by `<2>`), or hide itself (zero-width characters). Every place that shows text
of a calendar (log records, CLI tables, e-mails, the status page, metric
labels) passes it through `inert` (one line) or `inert_lines` (line breaks
kept, for text built by gpuresa around quoted values), which write every
such character as a visible escape (`\\x1b`, `\\u202e`, `\\n`).

What counts: the Unicode categories Cc (controls, NUL, CR and LF included),
Cf (format: bidi controls, zero-width joiners, soft hyphen…), Cs (lone
surrogates), Co (private use), Cn (unassigned), Zl and Zp (line and paragraph
separators). Ordinary spaces and every visible character are kept.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


@lru_cache(maxsize=4096)
def _is_hidden(character: str) -> bool:
    return unicodedata.category(character) in HIDDEN_CATEGORIES


def _escape(character: str) -> str:
    code = ord(character)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def inert(text: str) -> str:
    """`text` with every control, format and separator character written as an escape.

    Given any string; returns one line of visible characters and plain spaces
    (no line break, carriage return, escape sequence or bidi control is left).
    """
    if text.isascii() and text.isprintable():
        return text  # the common case, kept fast: printable ASCII has nothing to escape
    return "".join(_escape(char) if _is_hidden(char) else char for char in text)


def inert_lines(text: str) -> str:
    """`text` made inert line by line: its "\\n" line breaks (and tabs) are kept.

    For text that gpuresa lays out itself (an e-mail body, a table) around
    values that came from a calendar: those values must already be one line
    (see `inert`), so that they cannot add lines of their own.
    """
    return "\n".join(
        "\t".join(inert(cell) for cell in line.split("\t")) for line in text.split("\n")
    )


def echo(text: str = "") -> None:
    """Print one row or line of a CLI report on stdout, made inert.

    Given the line, perhaps after blank lines ("\\nrejected:"); every other line
    break in it came from a value, so the whole line is made one inert line.
    """
    core = text.lstrip("\n")
    print("\n" * (len(text) - len(core)) + inert(core))
