"""iCalendar text to event occurrences: a small, bounded reader and client-side expansion.

This is the "events" stage of the data flow: calendar objects go in, exact
occurrences (aware UTC start and end, keyed by UID + RECURRENCE-ID) come out,
each with the VEVENT that describes it; `gpuresa.reservations.rules` then reads the
booking out of that VEVENT. Nothing here does I/O or reads the clock.

Why not icalendar and recurring-ical-events in this path: measured on the
project's machine they take about 6 s to parse and 2 s to expand 10,000
events, where a daemon that polls every few seconds needs well under one; and
dateutil's rrule, which both rely on, loops until the year 9999 on a rule that
never matches (``FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30`` costs 10 s), which a
calendar anyone can write to must not be able to cause. So this module reads
the subset of RFC 5545 that bookings use, and expands recurrences with an
engine whose work is bounded by the window. icalendar still builds time zones
from VTIMEZONE definitions that no name identifies (Outlook's custom zones) and
supplies the Windows zone names; the test suite checks this reader against
icalendar, recurring-ical-events and dateutil as oracles.

What is read, and how:

- Lines are unfolded (after blank lines too); a property line is
  ``NAME;PARAM=value:value``. A line that is not spoils only the VEVENT it is
  in (another app's X- line is passed over); a broken structure (BEGIN/END
  that do not pair, text that is not iCalendar) spoils the whole object; text
  after the last END:VCALENDAR is passed over.
- An event without UID (a feed may leave it out) gets a key derived from its
  content (`Component.uid`), and says so (`Component.uid_derived`).
- Times: TZID names (IANA, Windows IDs and display names as Outlook writes
  them, or ``/vendor/Area/City``), else the object's VTIMEZONE of that TZID;
  UTC; floating times in the calendar's X-WR-TIMEZONE (Google), else the site
  zone; a calendar with X-WR-TIMEZONE also repeats its UTC series in that
  zone, as Google means it. All-day events run from 00:00 to 00:00 in the
  site zone; a date beside a date-time (DTSTART and DTEND of different kinds)
  is its 00:00 in the date-time's zone.
- Recurrence: RRULE (DAILY, WEEKLY, MONTHLY, YEARLY with INTERVAL, COUNT,
  UNTIL, BYDAY, BYMONTHDAY, BYMONTH, BYSETPOS, BYHOUR, BYMINUTE, BYSECOND,
  WKST), RDATE (dates, times, periods), EXDATE, and RECURRENCE-ID overrides
  (moved or cancelled occurrences, RANGE=THISANDFUTURE too, on all-day series
  by days). A date-time UNTIL on an all-day series counts in UTC, as the
  reference readers take it. Rules that repeat
  more often than daily, BYYEARDAY and BYWEEKNO are refused with a reason: no
  booking app writes them.

Where it lives: `gpuresa.ical.text` reads the lines into components,
`gpuresa.ical.zones` turns TZIDs into zones, `gpuresa.ical.recurrence` expands RRULEs;
this module turns values into times and events into occurrences, and keeps
the public names of all four.

What it costs: an object is read once per content (`parse_object` caches),
and what is computed from an event alone is kept with it, so a later poll of
an unchanged calendar only expands and checks; an object holding a single
event far outside the window is passed over with a few string searches
(`outside_window`); a series costs what its window holds, not its history.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import NamedTuple

from gpuresa.errors import EventError
from gpuresa.ical.recurrence import (
    MAX_OCCURRENCES_IN_WINDOW,
    MAX_PERIODS,
    Rule,
    expand_rule,
    read_rule,
)
from gpuresa.ical.text import (
    Component,
    ObjectContext,
    ParsedObject,
    Property,
    decode,
    parse_object,
    unescape_text,
)
from gpuresa.ical.zones import Zones, named_zone, zone_for

__all__ = [
    "MAX_DATES_IN_LIST",
    "MAX_OCCURRENCES_IN_WINDOW",
    "MAX_PERIODS",
    "MAX_RULES",
    "Component",
    "Duration",
    "EventError",
    "ObjectContext",
    "Occurrence",
    "ParsedObject",
    "Problem",
    "Property",
    "Rule",
    "Zones",
    "add_duration",
    "decode",
    "expand",
    "expand_rule",
    "localize",
    "outside_window",
    "parse_object",
    "read_duration",
    "read_rule",
    "read_stamp",
    "read_time",
    "read_times",
    "recurrence_text",
    "unescape_text",
    "zone_for",
]

# Work limits: what a hostile or broken calendar may cost before it is refused.
MAX_RULES = 4
MAX_DATES_IN_LIST = 1000

_DATE = re.compile(r"(\d{4})(\d{2})(\d{2})")
_DATE_TIME = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})(Z?)")
_DURATION = re.compile(
    r"([+-]?)P(?:(\d{1,6})W)?(?:(\d{1,6})D)?(?:T(?:(\d{1,7})H)?(?:(\d{1,9})M)?(?:(\d{1,10})S)?)?"
)


# --- time values --------------------------------------------------------------------------


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


# --- events to occurrences -------------------------------------------------------------------


class Occurrence(NamedTuple):
    """One occurrence: exact UTC times, and the VEVENT (series or override) describing it."""

    uid: str
    recurrence_id: str | None
    start: datetime
    end: datetime
    component: Component
    href: str


@dataclass(frozen=True, slots=True)
class Problem:
    """An object, event or occurrence that cannot be read, with the reason."""

    href: str
    reason: str
    uid: str | None = None
    recurrence_id: str | None = None
    component: Component | None = None
    start: datetime | None = None
    end: datetime | None = None


class _Timing(NamedTuple):
    """When an event (or series) happens: its start and how its end follows."""

    start: date | datetime
    duration: Duration  # days on the wall clock plus exact seconds
    end: datetime | None = None  # the exact end of the DTSTART instance, when DTEND says it

    @property
    def all_day(self) -> bool:
        return not isinstance(self.start, datetime)


def _timing(component: Component, zones: Zones, fallback: _Timing | None = None) -> _Timing:
    """DTSTART with DTEND or DURATION; raises `EventError` when they cannot be read."""
    context = component.context
    properties = component.properties
    for name in ("DTSTART", "DTEND", "DURATION"):
        if len(properties.get(name, ())) > 1:
            # RFC 5545 §3.6.1: at most one; which one the booking means is a guess
            raise EventError(f"the event has more than one {name}")
    found_start = component.first("DTSTART")
    if found_start is None:
        if fallback is None:
            raise EventError("the event has no DTSTART")
        return fallback
    start = read_time("DTSTART", found_start.value, found_start, context, zones)
    found_end = component.first("DTEND")
    found_duration = component.first("DURATION")
    if found_end is not None:
        end = read_time("DTEND", found_end.value, found_end, context, zones)
        # a date beside a date-time (RFC 5545 §3.8.2.2 wants the same kind): the date
        # stands for its 00:00 in the other's zone, and the event is a timed one
        if isinstance(end, datetime) and not isinstance(start, datetime):
            start = datetime.combine(start, time(), end.tzinfo)
        elif isinstance(start, datetime) and not isinstance(end, datetime):
            end = datetime.combine(end, time(), start.tzinfo)
        if end < start:  # both dates or both date-times here
            # RFC 5545 §3.8.2.2 wants DTEND later; the reference swaps them: a guess
            raise EventError("it ends before it starts")
        if isinstance(start, datetime) and isinstance(end, datetime):
            exact = int((end - start).total_seconds())
            return _Timing(start, Duration(0, exact), end.astimezone(UTC))
        return _Timing(start, Duration((end - start).days, 0))
    if found_duration is not None:
        duration = read_duration(found_duration.value)
        if not isinstance(start, datetime) and duration.seconds:
            raise EventError("an all-day event's DURATION must be whole days")
        return _Timing(start, duration)
    if fallback is not None:
        return _Timing(start, fallback.duration)
    if isinstance(start, datetime):
        return _Timing(start, Duration(0, 0))
    return _Timing(start, Duration(1, 0))  # an all-day event without end lasts its day


def _instance(
    timing: _Timing, wall: datetime, zone: tzinfo, site: tzinfo
) -> tuple[datetime, datetime]:
    """UTC start and end of the instance starting at `wall` (the series' wall clock)."""
    if timing.all_day:
        start = localize(wall, site)
        end = localize(wall + timedelta(days=timing.duration.days), site)
        return start, end
    start = localize(wall, zone)
    if timing.duration.days:
        end = localize(wall + timedelta(days=timing.duration.days), zone)
    else:
        end = start
    return start, end + timedelta(seconds=timing.duration.seconds)


def _wall(value: date | datetime) -> datetime:
    if isinstance(value, datetime):
        return value.replace(tzinfo=None)
    return datetime.combine(value, time())


def _status(component: Component) -> str:
    found = component.first("STATUS")
    return found.value.strip().upper() if found is not None else ""


def _sequence(component: Component) -> tuple[int, str]:
    """Which revision of a component is newer: SEQUENCE, then DTSTAMP text."""
    found = component.first("SEQUENCE")
    try:
        sequence = int(found.value.strip()) if found is not None else 0
    except ValueError:
        sequence = 0
    stamp = component.first("DTSTAMP")
    return sequence, stamp.value.strip() if stamp is not None else ""


class _Group:
    """The components of one UID in one calendar: the series and its overrides."""

    __slots__ = ("href", "master", "overrides", "uid")

    def __init__(self, uid: str, href: str) -> None:
        self.uid = uid
        self.href = href
        self.master: Component | None = None
        self.overrides: dict[str, tuple[Component, date | datetime]] = {}


def expand(
    objects: Iterable[tuple[str, ParsedObject]],
    window_start: datetime,
    window_end: datetime,
    site_zone: tzinfo,
) -> tuple[list[Occurrence], list[Problem]]:
    """Every occurrence of one calendar's events that overlaps [window_start, window_end).

    Given (href, parsed object) pairs of one calendar and an aware UTC window,
    returns the occurrences (cancelled ones left out) and the problems, each
    a whole object, a whole event (series) or one occurrence that cannot be
    read. The components of one UID are gathered across objects (an ICS
    folder may hold a series and its exceptions apart); of two revisions of
    the same component the newer (SEQUENCE, then DTSTAMP) counts. Never raises
    for any calendar content.
    """
    occurrences: list[Occurrence] = []
    problems: list[Problem] = []
    groups: dict[str, _Group] = {}
    for href, parsed in objects:
        if parsed.problem is not None:
            problems.append(Problem(href, parsed.problem))
            continue
        for component in parsed.events:
            uid = component.uid
            if component.problem is not None:
                problems.append(Problem(href, component.problem, uid=uid, component=component))
                continue
            group = groups.get(uid)
            if group is None:
                group = groups[uid] = _Group(uid, href)
            try:
                _add_to_group(group, component, _zones(component.context, site_zone))
            except EventError as error:
                problems.append(Problem(href, str(error), uid=uid, component=component))
    for group in groups.values():
        found: list[Occurrence] = []
        try:
            _expand_group(group, window_start, window_end, site_zone, found, problems)
        except (OverflowError, ValueError) as error:
            # dates beyond year 9999 and the like: the event, not the reader, is wrong
            reason = f"the event's dates cannot be computed ({error})"
            problems.append(Problem(group.href, reason, uid=group.uid, component=group.master))
            continue
        occurrences.extend(found)
    return occurrences, problems


def _zones(context: ObjectContext, site_zone: tzinfo) -> Zones:
    return _zones_for(context.calendar_zone, site_zone)


@functools.lru_cache(maxsize=256)
def _zones_for(calendar_zone: str | None, site_zone: tzinfo) -> Zones:
    if calendar_zone is None:
        return Zones(site_zone)
    return Zones(site_zone, named_zone(calendar_zone))


def _add_to_group(group: _Group, component: Component, zones: Zones) -> None:
    found = component.first("RECURRENCE-ID")
    if found is None:
        if group.master is None or _sequence(component) > _sequence(group.master):
            group.master = component
        return
    original = read_time("RECURRENCE-ID", found.value, found, component.context, zones)
    key = recurrence_text(original)
    present = group.overrides.get(key)
    if present is None or _sequence(component) > _sequence(present[0]):
        group.overrides[key] = (component, original)


def _overlaps(start: datetime, end: datetime, window_start: datetime, window_end: datetime) -> bool:
    """Does [start, end) meet the window? An event ending before it starts counts at its start."""
    if start >= window_end:
        return False
    return end > window_start if end > start else start >= window_start


def _is_this_and_future(component: Component) -> bool:
    found = component.first("RECURRENCE-ID")
    range_value = found.parameter("RANGE") if found is not None else None
    return (range_value or "").upper() == "THISANDFUTURE"


def _expand_group(
    group: _Group,
    window_start: datetime,
    window_end: datetime,
    site_zone: tzinfo,
    occurrences: list[Occurrence],
    problems: list[Problem],
) -> None:
    """The occurrences of one UID: the series' instances, then its overrides."""
    master = group.master
    uid = group.uid
    master_timing: _Timing | None = None
    if master is not None:
        zones = _zones(master.context, site_zone)
        if not group.overrides and _surely_outside(master, window_start, window_end):
            return
        try:
            master_timing = _timing_of(master, zones)
            if _status(master) == "CANCELLED":
                return  # a cancelled series cancels its exceptions too
            if master.all("RRULE") or master.all("RDATE"):
                # RANGE=THISANDFUTURE overrides of the series' kind (dates or times)
                future = sorted(
                    (original, component)
                    for component, original in group.overrides.values()
                    if isinstance(original, datetime) != master_timing.all_day
                    and _is_this_and_future(component)
                )
                _expand_series(
                    group,
                    master,
                    master_timing,
                    zones,
                    site_zone,
                    window_start,
                    window_end,
                    future,
                    occurrences,
                )
            elif recurrence_text(master_timing.start) in group.overrides:
                # a single event whose one occurrence was overridden: the override, same key
                component, _ = group.overrides.pop(recurrence_text(master_timing.start))
                _single(
                    uid,
                    None,
                    component,
                    group.href,
                    site_zone,
                    window_start,
                    window_end,
                    occurrences,
                    problems,
                    master_timing,
                )
            else:
                start, end = _instance(
                    master_timing,
                    _wall(master_timing.start),
                    _zone_of(master_timing, site_zone),
                    site_zone,
                )
                if master_timing.end is not None:
                    end = master_timing.end
                if _overlaps(start, end, window_start, window_end):
                    occurrences.append(Occurrence(uid, None, start, end, master, group.href))
        except EventError as error:
            start_time = None
            if master_timing is not None and isinstance(master_timing.start, datetime):
                start_time = master_timing.start.astimezone(UTC)
            problems.append(
                Problem(group.href, str(error), uid=uid, component=master, start=start_time)
            )
            return
    for key, (component, original) in group.overrides.items():
        _single(
            uid,
            key,
            component,
            group.href,
            site_zone,
            window_start,
            window_end,
            occurrences,
            problems,
            master_timing,
            original,
        )


def _surely_outside(component: Component, window_start: datetime, window_end: datetime) -> bool:
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


def _timing_of(component: Component, zones: Zones) -> _Timing:
    """`_timing`, computed once per component and zones (its failure too)."""
    key = ("timing", zones)
    found = component.derived.get(key)
    if found is None:
        try:
            found = _timing(component, zones)
        except EventError as error:
            found = error
        component.derived[key] = found
    if isinstance(found, EventError):
        raise found
    assert isinstance(found, _Timing)
    return found


def _rule_of(
    component: Component,
    text: str,
    zones: Zones,
    until_reader: Callable[[str], datetime],
    all_day: bool,
) -> Rule:
    """`read_rule`, computed once per component, rule text and zones (its failure too)."""
    key = ("rule", text, zones, all_day)
    found = component.derived.get(key)
    if found is None:
        try:
            found = read_rule(text, until_reader, all_day)
        except EventError as error:
            found = error
        component.derived[key] = found
    if isinstance(found, EventError):
        raise found
    assert isinstance(found, Rule)
    return found


_QUICK_MARGIN = timedelta(days=2)


def _quick_day(value: str) -> date | None:
    text = value.lstrip()[:8]
    if len(text) != 8 or not text.isascii() or not text.isdigit():
        return None
    try:
        return date(int(text[:4]), int(text[4:6]), int(text[6:]))
    except ValueError:
        return None


def _zone_of(timing: _Timing, site_zone: tzinfo) -> tzinfo:
    if isinstance(timing.start, datetime) and timing.start.tzinfo is not None:
        return timing.start.tzinfo
    return site_zone


def _single(
    uid: str,
    recurrence_id: str | None,
    component: Component,
    href: str,
    site_zone: tzinfo,
    window_start: datetime,
    window_end: datetime,
    occurrences: list[Occurrence],
    problems: list[Problem],
    fallback: _Timing | None,
    original: date | datetime | None = None,
) -> None:
    """One override (a moved, changed or cancelled occurrence), standing on its own."""
    if _status(component) == "CANCELLED":
        return
    zones = _zones(component.context, site_zone)
    try:
        if original is not None and component.first("DTSTART") is None:
            # an override without DTSTART stays where the series put it
            fallback = _Timing(original, fallback.duration if fallback else Duration(0, 0))
        timing = _timing(component, zones, fallback)
        start, end = _instance(timing, _wall(timing.start), _zone_of(timing, site_zone), site_zone)
        if timing.end is not None:
            end = timing.end
    except EventError as error:
        problems.append(
            Problem(href, str(error), uid=uid, recurrence_id=recurrence_id, component=component)
        )
        return
    if _overlaps(start, end, window_start, window_end):
        occurrences.append(Occurrence(uid, recurrence_id, start, end, component, href))


def _expand_series(
    group: _Group,
    master: Component,
    timing: _Timing,
    zones: Zones,
    site_zone: tzinfo,
    window_start: datetime,
    window_end: datetime,
    future: list[tuple[date, Component]],
    occurrences: list[Occurrence],
) -> None:
    """The instances of a recurring series that overlap the window; raises `EventError`."""
    context = master.context
    zone = _zone_of(timing, site_zone)
    start_wall = _wall(timing.start)
    # the window on the series' wall clock, widened by the longest offset and length
    margin = timedelta(days=abs(timing.duration.days) + 2, seconds=abs(timing.duration.seconds))
    low = (window_start - margin).astimezone(zone).replace(tzinfo=None)
    high = (window_end + timedelta(days=2)).astimezone(zone).replace(tzinfo=None)

    def until_reader(value: str) -> datetime:
        until = read_time("UNTIL", value, None, context, zones)
        if isinstance(until, datetime):
            if timing.all_day:
                # a date-time UNTIL on a series of dates (RFC 5545 §3.3.10 wants a date):
                # a day counts when its 00:00 on UNTIL's own clock (UTC for "Z") is not after
                # it, as the reference readers take it
                utc = value.strip().upper().endswith("Z")
                wall = (until.astimezone(UTC) if utc else until).replace(tzinfo=None)
            else:
                wall = until.astimezone(zone).replace(tzinfo=None)
        else:
            wall = datetime.combine(until, time(23, 59, 59))
        if wall < start_wall:
            # RFC 5545 counts DTSTART as the first instance, the reference finds none:
            # which the booker meant is a guess
            raise EventError(f"RRULE UNTIL {value.strip()!r} is before DTSTART")
        return wall

    walls: set[datetime] = set()
    rules = master.all("RRULE")
    if len(rules) > MAX_RULES:
        raise EventError(f"the event has more than {MAX_RULES} RRULEs")
    for found in rules:
        rule = _rule_of(master, found.value, zones, until_reader, timing.all_day)
        walls.update(expand_rule(rule, start_wall, low, high))
    if low <= start_wall <= high:
        walls.add(start_wall)  # DTSTART is always the first instance
    period_ends: dict[datetime, datetime] = {}  # RDATE;VALUE=PERIOD: start -> exact end
    for found in master.all("RDATE"):
        for value in read_times("RDATE", found, context, zones):
            if isinstance(value, tuple):
                if timing.all_day:
                    raise EventError("an all-day series cannot have RDATE periods")
                wall = value[0].astimezone(zone).replace(tzinfo=None)
                period_ends[wall] = value[1].astimezone(UTC)
            elif isinstance(value, datetime) == timing.all_day:
                raise EventError("RDATE must be of the same kind (date or date-time) as DTSTART")
            else:
                wall = _wall(value.astimezone(zone) if isinstance(value, datetime) else value)
            if low <= wall <= high:
                walls.add(wall)
    excluded_times: set[datetime] = set()
    excluded_days: set[date] = set()
    for found in master.all("EXDATE"):
        for value in read_times("EXDATE", found, context, zones):
            if isinstance(value, tuple):
                raise EventError("EXDATE cannot be a period")
            if isinstance(value, datetime):
                excluded_times.add(value.astimezone(UTC))
                if timing.all_day:
                    excluded_days.add(value.astimezone(site_zone).date())
            else:
                excluded_days.add(value)
    if len(walls) > MAX_OCCURRENCES_IN_WINDOW:
        raise EventError(
            f"the series has more than {MAX_OCCURRENCES_IN_WINDOW} occurrences in the window"
        )
    for wall in sorted(walls):
        start, end = _instance(timing, wall, zone, site_zone)
        if wall in period_ends:
            end = period_ends[wall]
        original: date | datetime = wall.date() if timing.all_day else start
        # EXDATE: the exact start, or (a date) every instance of that day
        if start in excluded_times or wall.date() in excluded_days:
            continue
        recurrence_id = recurrence_text(original)
        if recurrence_id in group.overrides:
            continue  # the override stands for it
        component = master
        applying = [item for item in future if item[0] <= original] if future else []
        if applying and timing.all_day:
            # RANGE=THISANDFUTURE on days: later days move by as many days as the override
            anchor, component = applying[-1]
            moved = _timing(component, _zones(component.context, site_zone), timing)
            if isinstance(moved.start, datetime):
                raise EventError("a THISANDFUTURE override must start on a date, like its series")
            start, end = _instance(moved, wall + (moved.start - anchor), zone, site_zone)
        elif applying:
            # RANGE=THISANDFUTURE: this and later instances move and change with the override
            anchor, component = applying[-1]
            moved = _timing(component, _zones(component.context, site_zone), timing)
            if not isinstance(moved.start, datetime) or not isinstance(anchor, datetime):
                raise EventError("a THISANDFUTURE override must start at a time, like its series")
            moved_start = moved.start.astimezone(UTC)
            if moved.end is not None:
                length = moved.end - moved_start
            else:
                length = (
                    _instance(moved, _wall(moved.start), _zone_of(moved, site_zone), site_zone)[1]
                    - moved_start
                )
            start = start + (moved_start - anchor.astimezone(UTC))
            end = start + length
        if _overlaps(start, end, window_start, window_end):
            occurrences.append(
                Occurrence(group.uid, recurrence_id, start, end, component, group.href)
            )


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
