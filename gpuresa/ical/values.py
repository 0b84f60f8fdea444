"""iCalendar values to Python times: DATE, DATE-TIME, PERIOD, DURATION, RECURRENCE-ID text.

Given property values and the zones they are read in, these functions return
`date`s and aware datetimes, or raise `EventError` naming the property; they do
no I/O and read no clock. Floating times take the calendar's zone, else the
site zone; a calendar with X-WR-TIMEZONE repeats its UTC times in that zone.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import NamedTuple

from gpuresa.errors import EventError
from gpuresa.ical.text import Component, ObjectContext, Property
from gpuresa.ical.zones import Zones, zone_for

# a work limit: what a hostile or broken calendar may cost before it is refused
MAX_DATES_IN_LIST = 1000

_DATE = re.compile(r"(\d{4})(\d{2})(\d{2})")
_DATE_TIME = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})(Z?)")
_DURATION = re.compile(
    r"([+-]?)P(?:(\d{1,6})W)?(?:(\d{1,6})D)?(?:T(?:(\d{1,7})H)?(?:(\d{1,9})M)?(?:(\d{1,10})S)?)?"
)


def read_time(
    property_name: str,
    value: str,
    parameters: Property | None,
    context: ObjectContext,
    zones: Zones,
) -> date | datetime:
    """One DATE or DATE-TIME value: a `date`, or an aware datetime in its wall-clock zone.

    Floating times get the calendar's zone, else the site zone; UTC times in a
    calendar with X-WR-TIMEZONE are moved into that zone (Google's meaning).
    Raises `EventError` naming `property_name` for anything unreadable.
    """
    value = value.strip()
    value_type = parameters.parameter("VALUE") if parameters is not None else None
    if len(value) == 8 and (value_type is None or value_type.upper() == "DATE"):
        match = _DATE.fullmatch(value)
        if match:
            try:
                return date(int(match[1]), int(match[2]), int(match[3]))
            except ValueError:
                pass
        raise EventError(f"{property_name} {value[:40]!r} is not a date")
    match = _DATE_TIME.fullmatch(value)
    if match is None:
        raise EventError(f"{property_name} {value[:40]!r} is not a date or a date-time")
    try:
        wall = datetime(
            int(match[1]),
            int(match[2]),
            int(match[3]),
            int(match[4]),
            int(match[5]),
            int(match[6]),
        )
    except ValueError:
        raise EventError(f"{property_name} {value[:40]!r} is not a valid date-time") from None
    if match[7]:
        if zones.calendar is not None:
            return wall.replace(tzinfo=UTC).astimezone(zones.calendar)
        return wall.replace(tzinfo=UTC)
    tzid = parameters.parameter("TZID") if parameters is not None else None
    if tzid:
        return wall.replace(tzinfo=zone_for(tzid, context.timezones))
    return wall.replace(tzinfo=zones.calendar or zones.site)


def read_times(
    property_name: str, found: Property, context: ObjectContext, zones: Zones
) -> list[date | datetime | tuple[datetime, datetime]]:
    """The comma-separated values of an RDATE or EXDATE; a PERIOD is (start, end)."""
    values = found.value.split(",")
    if len(values) > MAX_DATES_IN_LIST:
        raise EventError(f"{property_name} lists more than {MAX_DATES_IN_LIST} dates")
    result: list[date | datetime | tuple[datetime, datetime]] = []
    for value in values:
        if "/" in value:
            start_text, _, end_text = value.partition("/")
            if _DATE.fullmatch(start_text.strip()):
                # RFC 5545 §3.3.9: a period is bounded by date-times, never by dates
                raise EventError(f"{property_name} period {value[:40]!r} must start at a time")
            start = read_time(property_name, start_text, found, context, zones)
            if not isinstance(start, datetime):
                raise EventError(f"{property_name} period {value[:40]!r} must start at a time")
            if end_text.strip().lstrip("+-").startswith("P"):
                end = add_duration(start, read_duration(end_text))
            else:
                read_end = read_time(property_name, end_text, found, context, zones)
                if not isinstance(read_end, datetime):
                    raise EventError(f"{property_name} period {value[:40]!r} must end at a time")
                end = read_end
            result.append((start, end))
        elif value.strip():
            result.append(read_time(property_name, value, found, context, zones))
    return result


class Duration(NamedTuple):
    """A DURATION: whole days added on the calendar (wall clock), plus exact seconds."""

    days: int
    seconds: int


def read_duration(text: str) -> Duration:
    """`P1D`, `PT2H30M`, `P1W`, `-PT15M` -> `Duration`; raises `EventError` otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or text.strip().lstrip("+-") == "P" or text.strip().endswith("T"):
        raise EventError(f"DURATION {text[:40]!r} is not a duration such as PT2H or P1D")
    sign = -1 if match[1] == "-" else 1
    weeks, days, hours, minutes, seconds = (int(part or 0) for part in match.groups()[1:])
    total_days = sign * (weeks * 7 + days)
    total_seconds = sign * (hours * 3600 + minutes * 60 + seconds)
    if abs(total_days) > 3660 or abs(total_seconds) > 3660 * 86400:
        raise EventError(f"DURATION {text[:40]!r} is longer than ten years")
    return Duration(total_days, total_seconds)


def localize(wall: datetime, zone: tzinfo) -> datetime:
    """A wall-clock time in `zone` as UTC (a time in a DST gap moves forward, RFC 5545)."""
    if zone is UTC:
        return wall.replace(tzinfo=UTC)
    return wall.replace(tzinfo=zone).astimezone(UTC)


def add_duration(start: datetime, duration: Duration) -> datetime:
    """`start` (aware, in its wall zone) plus `duration`: days on the wall clock, then seconds."""
    zone = start.tzinfo
    assert zone is not None
    moved = localize(start.replace(tzinfo=None) + timedelta(days=duration.days), zone)
    return (moved + timedelta(seconds=duration.seconds)).astimezone(zone)


def recurrence_text(value: date | datetime) -> str:
    """The RECURRENCE-ID of an occurrence as keys spell it: `20260310` or `20260310T080000Z`."""
    if isinstance(value, datetime):
        value = value.astimezone(UTC)
        return (
            f"{value.year:04}{value.month:02}{value.day:02}"
            f"T{value.hour:02}{value.minute:02}{value.second:02}Z"
        )
    return f"{value.year:04}{value.month:02}{value.day:02}"


def read_stamp(component: Component, name: str, site_zone: tzinfo) -> datetime | None:
    """CREATED or DTSTAMP as an aware UTC datetime; None when absent or unreadable."""
    found = component.first(name)
    if found is None:
        return None
    value_text = found.value.strip()
    if len(value_text) == 16 and value_text[15] == "Z" and not found.parameters:
        # the usual spelling, 20260301T090000Z
        match = _DATE_TIME.fullmatch(value_text)
        if match is not None:
            try:
                return datetime(
                    int(match[1]),
                    int(match[2]),
                    int(match[3]),
                    int(match[4]),
                    int(match[5]),
                    int(match[6]),
                    tzinfo=UTC,
                )
            except ValueError:
                return None
    try:
        value = read_time(name, found.value, found, component.context, Zones(site_zone))
    except EventError:
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC)
    return datetime.combine(value, time(), UTC)
