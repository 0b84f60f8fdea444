"""A quick look at a single event's dates: is it surely outside the window?

Only the calendar dates written in DTSTART and DTEND are read (no zone can
move a time by more than a day), so most of a long history is passed over
without the full reading; anything unusual answers "read it", never "skip".
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from gpuresa.ical.text import Component


def surely_outside(component: Component, window_start: datetime, window_end: datetime) -> bool:
    """A quick look at the dates of a single event: does it end long before or start long after?

    Only the calendar dates written in DTSTART and DTEND are read (no zone can
    move a time by more than a day), so most of a long history is passed over
    without the full reading; anything unusual answers False, for the full one.
    """
    derived = component.derived
    if "quick days" not in derived:
        derived["quick days"] = _quick_days(component)
    days = derived["quick days"]
    if not isinstance(days, tuple):
        return False
    start_day: date = days[0]
    end_day: date | None = days[1]
    if start_day > (window_end + _QUICK_MARGIN).date():
        return True
    if end_day is None:
        return False
    earliest = (window_start - _QUICK_MARGIN).date()
    return end_day < earliest and start_day < earliest


def _quick_days(component: Component) -> tuple[date, date | None] | None:
    """The calendar dates DTSTART and DTEND name, if the event is single and they are plain."""
    if "RRULE" in component.properties or "RDATE" in component.properties:
        return None
    start = component.first("DTSTART")
    start_day = _quick_day(start.value) if start is not None else None
    if start_day is None:
        return None
    end = component.first("DTEND")
    return start_day, _quick_day(end.value) if end is not None else None


def outside_window(data: str | bytes, window_start: datetime, window_end: datetime) -> str | None:
    """The UID of an object that surely has nothing in the window, read without parsing it.

    An object written the usual way with one single event (no RRULE, RDATE or
    RECURRENCE-ID) whose DTSTART and DTEND dates lie two days or more outside
    the window cannot touch it: no zone moves a time by a day. Most objects of
    a calendar with some history are such; they cost a few string searches
    instead of a reading. Returns None when the object must be read (anything
    unusual, or something maybe inside the window).
    """
    text = data.decode("latin-1") if isinstance(data, bytes) else data
    begin = text.find("BEGIN:VEVENT")
    end = text.find("END:VEVENT", begin)
    if begin < 0 or end < 0 or text.find("BEGIN:VEVENT", begin + 12) >= 0:
        return None
    block = text[begin:end]
    if "RRULE" in block or "RDATE" in block or "RECURRENCE-ID" in block:
        return None
    start_day = _line_day(block, "\nDTSTART")
    end_day = _line_day(block, "\nDTEND")
    if start_day is None or end_day is None:
        return None
    earliest = (window_start - _QUICK_MARGIN).date()
    starts_after = start_day > (window_end + _QUICK_MARGIN).date()
    ended_before = end_day < earliest and start_day < earliest
    if not (starts_after or ended_before):
        return None
    uid_at = block.find("\nUID:")
    if uid_at < 0:
        return None
    uid_end = block.find("\n", uid_at + 5)
    if uid_end < 0 or block[uid_end + 1 : uid_end + 2] in (" ", "\t"):
        return None  # a folded UID: read it properly
    uid = block[uid_at + 5 : uid_end].strip()
    return uid if uid.isascii() and uid else None


def _line_day(block: str, marker: str) -> date | None:
    """The date that starts the value of the one `marker` line of `block`, if plain."""
    at = block.find(marker)
    if at < 0 or block.find(marker, at + 1) >= 0:
        return None
    line_end = block.find("\n", at + 1)
    if line_end < 0 or block[line_end + 1 : line_end + 2] in (" ", "\t"):
        return None  # folded: the date may be split
    line = block[at + 1 : line_end]
    colon = line.rfind(":")
    if colon < 0 or line[len(marker) - 1 : len(marker)] not in (":", ";"):
        return None
    return _quick_day(line[colon + 1 :])


_QUICK_MARGIN = timedelta(days=2)


def _quick_day(value: str) -> date | None:
    text = value.lstrip()[:8]
    if len(text) != 8 or not text.isascii() or not text.isdigit():
        return None
    try:
        return date(int(text[:4]), int(text[4:6]), int(text[6:]))
    except ValueError:
        return None
