"""One iCalendar content line taken apart: `NAME;PARAM=value;...:value`.

Quoted parameter values may hold ';' and ':' (RFC 5545 §3.1); these helpers
split outside the quotes and never raise: a line that is no property is None.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4096)
def parameter_values(raw: str) -> dict[str, str]:
    """`A=1;B="x;y"` -> {"A": "1", "B": "x;y"}; names upper case, quotes removed."""
    result: dict[str, str] = {}
    for part in _split_outside_quotes(raw, ";"):
        name, equals, value = part.partition("=")
        if not equals:
            continue
        result.setdefault(name.strip().upper(), value.replace('"', ""))
    return result


def _split_outside_quotes(text: str, separator: str) -> list[str]:
    if '"' not in text:
        return text.split(separator)
    parts: list[str] = []
    current: list[str] = []
    quoted = False
    for character in text:
        if character == '"':
            quoted = not quoted
        if character == separator and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(character)
    parts.append("".join(current))
    return parts


def split_line(line: str) -> tuple[str, str, str] | None:
    """`NAME;PARAMS:value` -> (NAME upper case, PARAMS, value); None when not a property."""
    colon = line.find(":")
    if colon <= 0:
        return None
    quote = line.find('"')
    if 0 <= quote < colon:
        # a quoted parameter value may hold ':' (ALTREP="http://..."); find the first outside
        quoted = False
        colon = -1
        for index, character in enumerate(line):
            if character == '"':
                quoted = not quoted
            elif character == ":" and not quoted:
                colon = index
                break
        if colon <= 0:
            return None
    head = line[:colon]
    semicolon = head.find(";")
    if semicolon < 0:
        return head.upper(), "", line[colon + 1 :]
    if semicolon == 0:
        return None
    return head[:semicolon].upper(), head[semicolon + 1 :], line[colon + 1 :]
