"""Calendar objects to validated reservations: reading each calendar, then all of them.

Pure: given the calendars' objects, the config and a window, these functions
return what the calendars ask for; they do no I/O and read no clock (the one
exception: when no template catalog is passed, it is read from the template
folders through `gpuresa.reservations.catalog.template_variants`).

Each occurrence is checked against the mapping rules of its calendar
(`gpuresa.reservations.booking`, which rejects that occurrence alone, with a
reason its user can act on); over-booking is decided across calendars by
`gpuresa.reservations.conflicts.resolve_conflicts`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from datetime import datetime
from types import MappingProxyType
from zoneinfo import ZoneInfo

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.sections import Config
from gpuresa.fairshare.check import RuleFacts, apply_rules
from gpuresa.ical.events import expand
from gpuresa.ical.text import ParsedObject, parse_object
from gpuresa.ical.window import outside_window
from gpuresa.model import (
    Rejection,
    Reservation,
    ReservationSet,
)
from gpuresa.reservations.booking import BookingReader
from gpuresa.reservations.claims import first_calendars, first_copies, moved_after_end
from gpuresa.reservations.conflicts import (
    NO_COUNTS,
    NOTHING_GRANTED,
    NOTHING_SEEN,
    rejection_order,
    reservation_order,
    resolve_conflicts,
)

log = logging.getLogger(__name__)

_NO_ORIGINS: Mapping[str, tuple[str, str]] = MappingProxyType({})


def read_calendar(
    calendar: CalendarConfig,
    config: Config,
    objects: Iterable[tuple[str, str | bytes]],
    window_start: datetime,
    window_end: datetime,
    *,
    variants: Mapping[str, tuple[str, ...]] | None = None,
    origins: Mapping[str, tuple[str, str]] = _NO_ORIGINS,
) -> ReservationSet:
    """The reservations and rejections of one calendar over [window_start, window_end).

    Given (href or file name, iCalendar text) pairs of one calendar, returns
    every occurrence that overlaps the window as a validated `Reservation`
    (host resolved, defaults filled) or a `Rejection` with its reason, plus a
    rejection for each object or event that cannot be read at all. Conflicts
    between reservations are not decided here (see `resolve_conflicts`).
    Tentative bookings are left out unless the calendar accepts them;
    cancelled ones are no reservation. Objects holding one single event whose
    dates lie well outside the window are not read at all (see
    `gpuresa.ical.window.outside_window`), so their flaws go unreported until their
    time comes near. `variants` is the template catalog
    (template -> CUDA variants, first = default); None reads it from disk.
    `origins`: where gpuresa first saw each UID ((calendar, href), from the
    journal): a UID in several objects counts in that one alone (see
    `gpuresa.reservations.claims.first_copies`). Never raises for anything in the
    calendar's text.
    """
    if variants is None:
        from gpuresa.reservations.catalog import template_variants

        variants = template_variants(config)
    site_zone = ZoneInfo(config.reservations.timezone)
    reader = BookingReader(calendar, config, variants, site_zone)
    reservations: list[Reservation] = []
    rejected: list[Rejection] = []
    parsed, copies = first_copies(
        calendar.name, _read_objects(objects, window_start, window_end), origins
    )
    rejected.extend(copies)
    reader.masters = {
        component.uid: component
        for _, item in parsed
        for component in item.events
        if component.first("RECURRENCE-ID") is None
    }
    occurrences, problems = expand(parsed, window_start, window_end, site_zone)
    for problem in problems:
        rejected.append(reader.reject_problem(problem))
    for occurrence in occurrences:
        outcome = reader.occurrence(occurrence)
        if isinstance(outcome, Reservation):
            reservations.append(outcome)
        elif outcome is not None:
            rejected.append(outcome)
    reservations.sort(key=reservation_order)
    rejected.sort(key=rejection_order)
    return ReservationSet(tuple(reservations), tuple(rejected))


def _read_objects(
    objects: Iterable[tuple[str, str | bytes]], window_start: datetime, window_end: datetime
) -> list[tuple[str, ParsedObject]]:
    """The objects read, except single events that surely lie outside the window.

    A skipped object is read all the same when its UID is also in a read one
    (a series and its exceptions in separate files, or two revisions), so
    what counts never depends on the skipping.
    """
    parsed: list[tuple[str, ParsedObject]] = []
    skipped: dict[str, list[tuple[str, str | bytes]]] = {}
    for href, data in objects:
        uid = outside_window(data, window_start, window_end)
        if uid is None:
            parsed.append((href, parse_object(data)))
        else:
            skipped.setdefault(uid, []).append((href, data))
    if skipped:
        read_uids = {component.uid for _, item in parsed for component in item.events}
        for uid, items in skipped.items():
            if uid in read_uids:
                parsed.extend((href, parse_object(data)) for href, data in items)
    return parsed


# --- over-booking -----------------------------------------------------------------------------


def read_reservations(
    config: Config,
    objects_by_calendar: Mapping[str, Iterable[tuple[str, str | bytes]]],
    window_start: datetime,
    window_end: datetime,
    *,
    variants: Mapping[str, tuple[str, ...]] | None = None,
    first_seen: Mapping[str, datetime] = NOTHING_SEEN,
    holding: AbstractSet[str] = frozenset(),
    granted: Mapping[str, tuple[datetime, datetime]] = NOTHING_GRANTED,
    ended: Mapping[str, tuple[datetime, datetime]] = NOTHING_GRANTED,
    origins: Mapping[str, tuple[str, str]] = _NO_ORIGINS,
    granted_gpus: Mapping[str, int] = NO_COUNTS,
    preemptible: AbstractSet[str] = frozenset(),
    rule_facts: RuleFacts | None = None,
) -> ReservationSet:
    """What all calendars ask for over the window, with over-booking decided.

    Given each configured calendar's objects by calendar name (calendars
    missing from the mapping are skipped), and, for over-booking, when each
    key was first seen and which keys hold a session (see
    `resolve_conflicts`; `granted` and `granted_gpus`: the interval and the
    GPU count each session was given; `preemptible`: the keys ever seen preemptible),
    and the times of the bookings whose session ended (`ended`: an ended
    occurrence never runs again; moved, it is a new booking, see
    `gpuresa.reservations.claims.moved_after_end`), returns the kept reservations
    sorted by start then key, and every rejection (unreadable, invalid or
    conflicting). A UID found in two calendars or objects counts once, where
    gpuresa first saw it (`origins`, see `gpuresa.reservations.claims`); every other copy
    is refused with its reason.

    With `rule_facts` (the time of the reading and what the journal and the
    host know, see `gpuresa.fairshare.check`), the fair-share rules of
    `config.rules` refuse what breaks a user's limits before over-booking is
    decided, so a refused booking takes no GPU from others; without, no rule
    is applied.
    """
    if variants is None:
        from gpuresa.reservations.catalog import template_variants

        variants = template_variants(config)
    found = _read_all(config, objects_by_calendar, window_start, window_end, variants, origins)
    found = replace(found, reservations=moved_after_end(found.reservations, ended))
    if rule_facts is not None and config.rules.active:
        kept, refused = apply_rules(
            found.reservations,
            config.rules,
            rule_facts,
            ZoneInfo(config.reservations.timezone),
            first_seen=first_seen,
            holding=holding,
            preemptible=preemptible,
        )
        found = ReservationSet(tuple(kept), (*found.rejected, *refused))
    return _resolve(found, config, first_seen, holding, granted, granted_gpus, preemptible)


def _read_all(
    config: Config,
    objects_by_calendar: Mapping[str, Iterable[tuple[str, str | bytes]]],
    window_start: datetime,
    window_end: datetime,
    variants: Mapping[str, tuple[str, ...]],
    origins: Mapping[str, tuple[str, str]],
) -> ReservationSet:
    rejected: list[Rejection] = []
    by_calendar: dict[str, tuple[Reservation, ...]] = {}
    for calendar in config.calendars:
        objects = objects_by_calendar.get(calendar.name)
        if objects is None:
            continue
        found = read_calendar(
            calendar, config, objects, window_start, window_end, variants=variants, origins=origins
        )
        by_calendar[calendar.name] = found.reservations
        rejected.extend(found.rejected)
    order = [calendar.name for calendar in config.calendars]
    everything, copies = first_calendars(by_calendar, order, origins)
    rejected.extend(copies)
    for name in objects_by_calendar:
        if name not in {calendar.name for calendar in config.calendars}:
            log.warning("objects given for calendar %r, which the config does not list", name)
    return ReservationSet(tuple(everything), tuple(rejected))


def _resolve(
    found: ReservationSet,
    config: Config,
    first_seen: Mapping[str, datetime],
    holding: AbstractSet[str],
    granted: Mapping[str, tuple[datetime, datetime]] = NOTHING_GRANTED,
    granted_gpus: Mapping[str, int] = NO_COUNTS,
    preemptible: AbstractSet[str] = frozenset(),
) -> ReservationSet:
    """`found`'s reservations with over-booking decided; its rejections kept."""
    resolved = resolve_conflicts(
        found.reservations,
        config,
        first_seen=first_seen,
        holding=holding,
        granted=granted,
        granted_gpus=granted_gpus,
        preemptible=preemptible,
    )
    rejected = sorted((*found.rejected, *resolved.rejected), key=rejection_order)
    return replace(resolved, rejected=tuple(rejected))
