"""iCalendar text to event occurrences: a small, bounded reader and client-side expansion.

This is the "events" stage of the data flow: calendar objects go in, exact
occurrences (aware UTC start and end, keyed by UID + RECURRENCE-ID) come out,
each with the VEVENT that describes it; `gpuresa.reservations.booking` then reads the
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
`gpuresa.ical.zones` turns TZIDs into zones, `gpuresa.ical.values` turns values
into times, `gpuresa.ical.timing` reads when one event happens,
`gpuresa.ical.recurrence` expands RRULEs, `gpuresa.ical.series` a whole
series, `gpuresa.ical.window` passes over what is surely outside the window;
this module gathers the events of each UID and turns them into occurrences
(`gpuresa.ical.occurrence`).

What it costs: an object is read once per content (`parse_object` caches),
and what is computed from an event alone is kept with it, so a later poll of
an unchanged calendar only expands and checks; an object holding a single
event far outside the window is passed over with a few string searches
(`outside_window`); a series costs what its window holds, not its history.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, date, datetime, tzinfo

from gpuresa.errors import EventError
from gpuresa.ical.occurrence import Occurrence, Problem, UidGroup
from gpuresa.ical.series import expand_series
from gpuresa.ical.text import Component, ParsedObject
from gpuresa.ical.timing import (
    Timing,
    cached_timing,
    event_status,
    event_zones,
    instance_times,
    overlaps_window,
    read_timing,
    series_zone,
    wall_clock,
)
from gpuresa.ical.values import Duration, read_time, recurrence_text
from gpuresa.ical.window import surely_outside
from gpuresa.ical.zones import Zones

# --- events to occurrences -------------------------------------------------------------------


def _sequence(component: Component) -> tuple[int, str]:
    """Which revision of a component is newer: SEQUENCE, then DTSTAMP text."""
    found = component.first("SEQUENCE")
    try:
        sequence = int(found.value.strip()) if found is not None else 0
    except ValueError:
        sequence = 0
    stamp = component.first("DTSTAMP")
    return sequence, stamp.value.strip() if stamp is not None else ""


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
    groups: dict[str, UidGroup] = {}
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
                group = groups[uid] = UidGroup(uid, href)
            try:
                _add_to_group(group, component, event_zones(component.context, site_zone))
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


def _add_to_group(group: UidGroup, component: Component, zones: Zones) -> None:
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


def _is_this_and_future(component: Component) -> bool:
    found = component.first("RECURRENCE-ID")
    range_value = found.parameter("RANGE") if found is not None else None
    return (range_value or "").upper() == "THISANDFUTURE"


def _expand_group(
    group: UidGroup,
    window_start: datetime,
    window_end: datetime,
    site_zone: tzinfo,
    occurrences: list[Occurrence],
    problems: list[Problem],
) -> None:
    """The occurrences of one UID: the series' instances, then its overrides."""
    master = group.master
    uid = group.uid
    master_timing: Timing | None = None
    if master is not None:
        zones = event_zones(master.context, site_zone)
        if not group.overrides and surely_outside(master, window_start, window_end):
            return
        try:
            master_timing = cached_timing(master, zones)
            if event_status(master) == "CANCELLED":
                return  # a cancelled series cancels its exceptions too
            if master.all("RRULE") or master.all("RDATE"):
                # RANGE=THISANDFUTURE overrides of the series' kind (dates or times)
                future = sorted(
                    (original, component)
                    for component, original in group.overrides.values()
                    if isinstance(original, datetime) != master_timing.all_day
                    and _is_this_and_future(component)
                )
                expand_series(
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
                start, end = instance_times(
                    master_timing,
                    wall_clock(master_timing.start),
                    series_zone(master_timing, site_zone),
                    site_zone,
                )
                if master_timing.end is not None:
                    end = master_timing.end
                if overlaps_window(start, end, window_start, window_end):
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
    fallback: Timing | None,
    original: date | datetime | None = None,
) -> None:
    """One override (a moved, changed or cancelled occurrence), standing on its own."""
    if event_status(component) == "CANCELLED":
        return
    zones = event_zones(component.context, site_zone)
    try:
        if original is not None and component.first("DTSTART") is None:
            # an override without DTSTART stays where the series put it
            fallback = Timing(original, fallback.duration if fallback else Duration(0, 0))
        timing = read_timing(component, zones, fallback)
        start, end = instance_times(
            timing, wall_clock(timing.start), series_zone(timing, site_zone), site_zone
        )
        if timing.end is not None:
            end = timing.end
    except EventError as error:
        problems.append(
            Problem(href, str(error), uid=uid, recurrence_id=recurrence_id, component=component)
        )
        return
    if overlaps_window(start, end, window_start, window_end):
        occurrences.append(Occurrence(uid, recurrence_id, start, end, component, href))
