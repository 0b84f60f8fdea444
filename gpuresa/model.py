"""The values every part of gpuresa passes around: reservations, rejections, sessions.

All instants are aware datetimes in UTC. These types carry no behaviour that
does I/O, so the planner and its tests can build them freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path


def occurrence_key(uid: str, recurrence_id: str | None) -> str:
    """The key of one occurrence: the UID, plus "@" and the RECURRENCE-ID for a series."""
    return uid if recurrence_id is None else f"{uid}@{recurrence_id}"


@dataclass(frozen=True)
class Reservation:
    """One validated occurrence of a booking: who gets which GPUs on which host, when."""

    key: str
    uid: str
    recurrence_id: str | None
    calendar: str
    host: str
    user: str
    template: str
    cuda: str | None
    gpus: int
    start: datetime
    end: datetime
    email: str | None = None
    summary: str = ""
    # order of booking, for over-booking conflicts: earliest wins
    created: datetime | None = None
    stamp: datetime | None = None
    tentative: bool = False
    # the event has no UID: `uid` is derived from its content (gpuresa.ical.text)
    uid_derived: bool = False
    # the calendar object (href or file name) the booking was read from
    href: str = ""


@dataclass(frozen=True)
class Rejection:
    """An occurrence (or a whole calendar object) that cannot become a reservation."""

    key: str
    uid: str
    calendar: str
    reason: str
    user: str | None = None
    email: str | None = None
    start: datetime | None = None
    end: datetime | None = None
    # the event has no UID: `uid` is derived from its content (gpuresa.ical.text)
    uid_derived: bool = False


@dataclass(frozen=True)
class ReservationSet:
    """What the calendars ask for over a window: reservations and rejections."""

    reservations: tuple[Reservation, ...] = ()
    rejected: tuple[Rejection, ...] = ()


@dataclass(frozen=True)
class SessionSpec:
    """What the runtime needs to create a session; ports and GPUs already chosen."""

    key: str
    user: str
    host: str
    template: str
    cuda: str | None
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    ssh_port: int
    ftp_port: int
    ftp_passive_first: int
    ftp_passive_last: int
    email: str | None = None
    # where a scheduler runs it: a node, "partition:<name>" or "" (any; engines ignore it)
    place: str = ""


@dataclass(frozen=True)
class IdRange:
    """The host uids and gids a session's user namespace maps ids 0 to count-1 onto."""

    uid: int
    gid: int
    count: int

    def __str__(self) -> str:
        return f"{self.uid}-{self.uid + self.count - 1}"


@dataclass(frozen=True)
class Session:
    """A session as Docker shows it, rebuilt from the containers' `gpuresa.*` labels."""

    key: str
    user: str
    host: str
    template: str
    cuda: str | None
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    ssh_port: int
    ftp_port: int
    ftp_passive_first: int
    ftp_passive_last: int
    # "created" (prepared, not started), "running", or "stopped" (exited, not removed)
    state: str
    output_dir: Path
    ftp_user: str = ""
    ftp_password: str = field(default="", repr=False)
    email: str | None = None
    containers: tuple[str, ...] = ()
    # the host ids of the session's user namespace (None: none, or not known)
    id_range: IdRange | None = None
    # the node a scheduler runs it on ("" for an engine's session)
    place: str = ""
