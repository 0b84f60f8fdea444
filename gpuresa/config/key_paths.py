"""How problems name a calendar: `calendars[gpu1]`, by its name, as the daemon's messages do.

A calendar's position in the file changes when one is added above it; its
name does not, and it is what the daemon's logs, the journal and `gpuresa
status` call it. The loader and the checks find problems by position
(`calendars[0]`); `name_calendars` rewrites them, once, before they are shown.
A calendar whose name is missing, malformed or shared with another keeps its
position: nothing else names it without ambiguity.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gpuresa.config.names import NAME

_BY_POSITION = re.compile(r"(?<![\w.\]])calendars\[(\d+)\]")


def calendar_label(names: Sequence[object], index: int) -> str:
    """`calendars[NAME]` for the calendar at `index`, else `calendars[INDEX]`.

    `names` are the calendars' `name` values as written (anything, before the
    schema checked them).
    """
    name = names[index] if 0 <= index < len(names) else None
    if isinstance(name, str) and re.fullmatch(NAME, name) and names.count(name) == 1:
        return f"calendars[{name}]"
    return f"calendars[{index}]"


def raw_calendar_names(document: object) -> list[object]:
    """The `name` of each [[calendars]] table of a parsed TOML document, as written."""
    calendars = document.get("calendars") if isinstance(document, Mapping) else None
    if not isinstance(calendars, list):
        return []
    return [table.get("name") if isinstance(table, Mapping) else None for table in calendars]


def name_calendars(problems: Sequence[str], names: Sequence[object]) -> list[str]:
    """`problems` with each `calendars[INDEX]` written as `calendar_label` gives it."""
    return [
        _BY_POSITION.sub(lambda found: calendar_label(names, int(found.group(1))), problem)
        for problem in problems
    ]
