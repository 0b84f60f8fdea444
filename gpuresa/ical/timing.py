"""When one event happens: its DTSTART with DTEND or DURATION, and the instants of an instance.

`read_timing` reads a VEVENT's start and how its end follows (raising
`EventError` for what cannot be read); `instance_times` turns a start on the
series' wall clock into exact UTC times. Nothing here does I/O or reads the
clock; what is computed from an event alone is kept with it (`cached_timing`).
"""

from __future__ import annotations

import functools
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import NamedTuple

from gpuresa.errors import EventError
from gpuresa.ical.text import Component, ObjectContext
from gpuresa.ical.values import Duration, localize, read_duration, read_time
from gpuresa.ical.zones import Zones, named_zone


class Timing(NamedTuple):
    """When an event (or series) happens: its start and how its end follows."""

    start: date | datetime
    duration: Duration  # days on the wall clock plus exact seconds
    end: datetime | None = None  # the exact end of the DTSTART instance, when DTEND says it

    @property
    def all_day(self) -> bool:
        return not isinstance(self.start, datetime)


def read_timing(component: Component, zones: Zones, fallback: Timing | None = None) -> Timing:
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
            return Timing(start, Duration(0, exact), end.astimezone(UTC))
        return Timing(start, Duration((end - start).days, 0))
    if found_duration is not None:
        duration = read_duration(found_duration.value)
        if not isinstance(start, datetime) and duration.seconds:
            raise EventError("an all-day event's DURATION must be whole days")
        return Timing(start, duration)
    if fallback is not None:
        return Timing(start, fallback.duration)
    if isinstance(start, datetime):
        return Timing(start, Duration(0, 0))
    return Timing(start, Duration(1, 0))  # an all-day event without end lasts its day


def instance_times(
    timing: Timing, wall: datetime, zone: tzinfo, site: tzinfo
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


def wall_clock(value: date | datetime) -> datetime:
    if isinstance(value, datetime):
        return value.replace(tzinfo=None)
    return datetime.combine(value, time())


def event_status(component: Component) -> str:
    found = component.first("STATUS")
    return found.value.strip().upper() if found is not None else ""


def event_zones(context: ObjectContext, site_zone: tzinfo) -> Zones:
    return _zones_for(context.calendar_zone, site_zone)


@functools.lru_cache(maxsize=256)
def _zones_for(calendar_zone: str | None, site_zone: tzinfo) -> Zones:
    if calendar_zone is None:
        return Zones(site_zone)
    return Zones(site_zone, named_zone(calendar_zone))


def overlaps_window(
    start: datetime, end: datetime, window_start: datetime, window_end: datetime
) -> bool:
    """Does [start, end) meet the window? An event ending before it starts counts at its start."""
    if start >= window_end:
        return False
    return end > window_start if end > start else start >= window_start


def cached_timing(component: Component, zones: Zones) -> Timing:
    """`read_timing`, computed once per component and zones (its failure too)."""
    key = ("timing", zones)
    found = component.derived.get(key)
    if found is None:
        try:
            found = read_timing(component, zones)
        except EventError as error:
            found = error
        component.derived[key] = found
    if isinstance(found, EventError):
        raise found
    assert isinstance(found, Timing)
    return found


def series_zone(timing: Timing, site_zone: tzinfo) -> tzinfo:
    if isinstance(timing.start, datetime) and timing.start.tzinfo is not None:
        return timing.start.tzinfo
    return site_zone
