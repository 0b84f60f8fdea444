"""The instances of a recurring series (RRULE, RDATE, EXDATE, THISANDFUTURE) in a window.

Given a series' VEVENT, its timing and the window, `expand_series` adds the
occurrences that overlap the window, skipping those an override stands for;
raises `EventError` for a series that cannot be read. The work is bounded by
what the window holds (`gpuresa.ical.recurrence`), not by the series' history.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta, tzinfo

from gpuresa.errors import EventError
from gpuresa.ical.occurrence import Occurrence, UidGroup
from gpuresa.ical.recurrence import MAX_OCCURRENCES_IN_WINDOW, Rule, expand_rule, read_rule
from gpuresa.ical.text import Component
from gpuresa.ical.timing import (
    Timing,
    event_zones,
    instance_times,
    overlaps_window,
    read_timing,
    series_zone,
    wall_clock,
)
from gpuresa.ical.values import read_time, read_times, recurrence_text
from gpuresa.ical.zones import Zones

# Work limits: what a hostile or broken calendar may cost before it is refused.
MAX_RULES = 4


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


def expand_series(
    group: UidGroup,
    master: Component,
    timing: Timing,
    zones: Zones,
    site_zone: tzinfo,
    window_start: datetime,
    window_end: datetime,
    future: list[tuple[date, Component]],
    occurrences: list[Occurrence],
) -> None:
    """The instances of a recurring series that overlap the window; raises `EventError`."""
    context = master.context
    zone = series_zone(timing, site_zone)
    start_wall = wall_clock(timing.start)
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
                wall = wall_clock(value.astimezone(zone) if isinstance(value, datetime) else value)
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
        start, end = instance_times(timing, wall, zone, site_zone)
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
            moved = read_timing(component, event_zones(component.context, site_zone), timing)
            if isinstance(moved.start, datetime):
                raise EventError("a THISANDFUTURE override must start on a date, like its series")
            start, end = instance_times(moved, wall + (moved.start - anchor), zone, site_zone)
        elif applying:
            # RANGE=THISANDFUTURE: this and later instances move and change with the override
            anchor, component = applying[-1]
            moved = read_timing(component, event_zones(component.context, site_zone), timing)
            if not isinstance(moved.start, datetime) or not isinstance(anchor, datetime):
                raise EventError("a THISANDFUTURE override must start at a time, like its series")
            moved_start = moved.start.astimezone(UTC)
            if moved.end is not None:
                length = moved.end - moved_start
            else:
                length = (
                    instance_times(
                        moved, wall_clock(moved.start), series_zone(moved, site_zone), site_zone
                    )[1]
                    - moved_start
                )
            start = start + (moved_start - anchor.astimezone(UTC))
            end = start + length
        if overlaps_window(start, end, window_start, window_end):
            occurrences.append(
                Occurrence(group.uid, recurrence_id, start, end, component, group.href)
            )
