"""Text in words for notices: one-line text, times in the site's zone, durations.

Pure functions shared by the notices (`gpuresa.mail.notices`, `gpuresa.outputs.messages`)
and the SMTP gateway's headers and logs (`gpuresa.mail.smtp`).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gpuresa.inert import inert

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# Line breaks and blanks of every kind: one space each in a one-line text.
BREAKS = re.compile(r"[\t\n\v\f\r\x1c-\x1f\x85\u2028\u2029]")


def one_line(text: str, limit: int | None = None) -> str:
    """`text` as one line of printable characters: every run of line breaks and
    white space becomes one space, every other control or format character an
    escape (`gpuresa.inert`); cut to `limit` characters (with "…") if given.
    """
    flattened = " ".join(inert(BREAKS.sub(" ", text)).split())
    if limit is not None and len(flattened) > limit:
        flattened = flattened[: limit - 1].rstrip() + "…"
    return flattened


def format_time(instant: datetime, timezone: str, *, offset: bool = True) -> str:
    """`instant` in the site's time zone, with the zone's name and UTC offset.

    Given an aware datetime and an IANA zone name; returns, for example,
    "Friday 2024-05-03 18:00 CEST (UTC+02:00)", without the "(UTC…)" part
    when `offset` is false (for subjects: see `format_clock`). English
    weekday names whatever the locale.
    """
    local = instant.astimezone(ZoneInfo(timezone))
    text = f"{WEEKDAYS[local.weekday()]} {local:%Y-%m-%d %H:%M} {local.tzname()}"
    return f"{text} ({_utc_offset(local)})" if offset else text


def format_clock(instant: datetime, timezone: str, *, offset: bool = True) -> str:
    """`instant` as a clock time in the site's zone: "18:00 CEST (UTC+02:00)".

    Without `offset`, only "18:00 CEST" (for subjects: the parentheses make
    Python's header folding start a continuation line).
    """
    local = instant.astimezone(ZoneInfo(timezone))
    if not offset:
        return f"{local:%H:%M} {local.tzname()}"
    return f"{local:%H:%M} {local.tzname()} ({_utc_offset(local)})"


def _utc_offset(local: datetime) -> str:
    offset = local.utcoffset() or timedelta(0)
    sign = "-" if offset < timedelta(0) else "+"
    minutes = abs(int(offset.total_seconds())) // 60
    return f"UTC{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def format_remaining(remaining: timedelta) -> str:
    """A duration in words, to the minute (to the second under a minute).

    "15 minutes", "1 hour 5 minutes", "2 days 3 hours", "30 seconds".
    """
    seconds = max(0, round(remaining.total_seconds()))
    if seconds < 60:
        return plural(seconds, "second")
    minutes = round(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    parts = [
        plural(amount, unit)
        for amount, unit in ((days, "day"), (hours, "hour"), (minutes, "minute"))
        if amount
    ]
    return " ".join(parts)


def plural(amount: int, unit: str) -> str:
    return f"{amount} {unit}" if amount == 1 else f"{amount} {unit}s"
