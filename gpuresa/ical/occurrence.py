"""What expanding a calendar yields: occurrences, problems, and the components of one UID."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import NamedTuple

from gpuresa.ical.text import Component


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


class UidGroup:
    """The components of one UID in one calendar: the series and its overrides."""

    __slots__ = ("href", "master", "overrides", "uid")

    def __init__(self, uid: str, href: str) -> None:
        self.uid = uid
        self.href = href
        self.master: Component | None = None
        self.overrides: dict[str, tuple[Component, date | datetime]] = {}
