"""Who may claim a booking: one copy of each UID, and an ended occurrence never twice.

Anyone who can write to a calendar can write any UID and any time, so what
a booking is owed must not follow from what its text says:

- the same UID in two calendars, or in two objects of one calendar, or two
  series of it in one object, is one booking: the copy gpuresa saw first
  (the journal's origin of that UID) keeps it, every other copy is refused
  with a reason; with no history, the calendar listed first, then the object
  whose name sorts first;
- an occurrence whose session ended is over: the same key with other times
  is a new booking (`moved_after_end`), with a key of its own, ranked from
  when it was first seen with those times.

Pure: the journal's knowledge comes in as arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from datetime import datetime

from gpuresa.ical.text import ParsedObject
from gpuresa.model import Rejection, Reservation, calendar_key

# Keys that the daemon makes itself from a booking's: a calendar's key never has a "/"
# (a UID holding one is refused), so these cannot be claimed from a calendar.
COPY_MARK = "/copy"
MOVED_MARK = "/moved-"


@dataclass(frozen=True)
class Claims:
    """What the journal and the sessions say each booking is owed, for the reader.

    granted: the interval each prepared, running or ended session was given;
    granted_gpus: the GPU count each such session was given (a raise of it
    is a growth, see `gpuresa.reservations.conflicts.resolve_conflicts`);
    ended: the times each ended occurrence had at its end;
    origins: where gpuresa first saw each UID, (calendar, href);
    preemptible: the keys ever seen preemptible, which stay so (see
    `gpuresa.reservations.conflicts.resolve_conflicts`).
    """

    granted: Mapping[str, tuple[datetime, datetime]] = field(default_factory=dict)
    granted_gpus: Mapping[str, int] = field(default_factory=dict)
    ended: Mapping[str, tuple[datetime, datetime]] = field(default_factory=dict)
    origins: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    preemptible: AbstractSet[str] = frozenset()


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y%m%dT%H%M%SZ")


def moved_key(key: str, start: datetime, end: datetime) -> str:
    """The key of an ended occurrence moved to [start, end): a new booking."""
    return f"{key}{MOVED_MARK}{_stamp(start)}-{_stamp(end)}"


def moved_after_end(
    reservations: Iterable[Reservation], ended: Mapping[str, tuple[datetime, datetime]]
) -> tuple[Reservation, ...]:
    """The reservations, each ended one whose times moved given a key of its own.

    `ended`: the times each ended occurrence had when its session ended (by
    key). An occurrence with the same times stays as it is (it is over, the
    planner starts nothing); with other times it becomes a new booking.
    """
    found = []
    for reservation in reservations:
        times = ended.get(reservation.key)
        if times is not None and times != (reservation.start, reservation.end):
            key = moved_key(reservation.key, reservation.start, reservation.end)
            reservation = replace(reservation, key=key)
        found.append(reservation)
    return tuple(found)


def copy_rejection(uid: str, calendar: str, where: str, reason: str) -> Rejection:
    """The refusal of one copy of a UID, keyed apart from the booking it copies."""
    return Rejection(
        key=f"{calendar_key(uid)}{COPY_MARK}/{calendar}/{where}",
        uid=uid,
        calendar=calendar,
        reason=reason,
    )


def first_copies(
    calendar: str,
    objects: list[tuple[str, ParsedObject]],
    origins: Mapping[str, tuple[str, str]],
) -> tuple[list[tuple[str, ParsedObject]], list[Rejection]]:
    """One calendar's objects with every copy of a UID but the first taken out.

    Given (href, parsed object) pairs and the journal's origin of each UID
    ((calendar, href) where gpuresa first saw it); returns the objects, each
    holding only the UIDs it owns, and a rejection for each copy taken out:
    a UID's components in another object than its first, and a second series
    (no RECURRENCE-ID) or override of the same occurrence in one object.
    """
    hrefs: dict[str, list[str]] = {}
    for href, parsed in objects:
        for uid in dict.fromkeys(component.uid for component in parsed.events):
            hrefs.setdefault(uid, []).append(href)
    owner: dict[str, str] = {}
    for uid, found in hrefs.items():
        origin = origins.get(uid)
        if origin is not None and origin[0] == calendar and origin[1] in found:
            owner[uid] = origin[1]
        else:
            owner[uid] = min(found)
    kept: list[tuple[str, ParsedObject]] = []
    rejected: list[Rejection] = []
    for href, parsed in objects:
        events = []
        seen: set[tuple[str, str]] = set()
        for component in parsed.events:
            uid = component.uid
            if owner.get(uid, href) != href:
                reason = (
                    f"the UID {uid!r} is already the booking of {owner[uid]} in calendar "
                    f"{calendar}; this copy in {href} is refused"
                )
                rejected.append(copy_rejection(uid, calendar, href, reason))
                continue
            recurrence = component.first("RECURRENCE-ID")
            which = (uid, recurrence.value.strip() if recurrence is not None else "")
            if which in seen:
                what = "occurrence" if recurrence is not None else "event"
                reason = (
                    f"{href} holds the {what} {uid!r} twice; the first counts, this copy is refused"
                )
                where = f"{href}#{component.position}"
                rejected.append(copy_rejection(uid, calendar, where, reason))
                continue
            seen.add(which)
            events.append(component)
        kept.append((href, parsed._replace(events=tuple(events))))
    return kept, rejected


def first_calendars(
    found: Mapping[str, Iterable[Reservation]],
    order: list[str],
    origins: Mapping[str, tuple[str, str]],
) -> tuple[list[Reservation], list[Rejection]]:
    """The reservations of every calendar, each UID kept in one calendar only.

    `found`: each calendar's reservations; `order`: the calendars as the
    config lists them; `origins`: see `first_copies`. The calendar where
    gpuresa first saw a UID keeps it; with no history, the one listed first.
    """
    calendars_of: dict[str, list[str]] = {}
    for name in order:
        for reservation in found.get(name, ()):
            listed = calendars_of.setdefault(reservation.uid, [])
            if name not in listed:
                listed.append(name)
    kept: list[Reservation] = []
    rejected: list[Rejection] = []
    for name in order:
        for reservation in found.get(name, ()):
            listed = calendars_of[reservation.uid]
            origin = origins.get(reservation.uid)
            owner = origin[0] if origin is not None and origin[0] in listed else listed[0]
            if owner == name:
                kept.append(reservation)
                continue
            reason = (
                f"the UID {reservation.uid!r} is already a booking in calendar {owner}; "
                f"this copy in calendar {name} is refused"
            )
            refusal = copy_rejection(reservation.uid, name, reservation.key, reason)
            rejected.append(
                replace(
                    refusal,
                    user=reservation.user,
                    email=reservation.email,
                    start=reservation.start,
                    end=reservation.end,
                )
            )
    return kept, rejected
