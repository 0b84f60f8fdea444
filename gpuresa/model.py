"""The values every part of gpuresa passes around: reservations, rejections, sessions.

All instants are aware datetimes in UTC. These types carry no behaviour that
does I/O, so the planner and its tests can build them freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

# Keys gpuresa makes for itself (ad-hoc sessions, benches) start with INTERNAL_MARK; a key
# made from calendar text never does (see `calendar_key`), so no calendar can name one.
INTERNAL_MARK = "@"
# what calendar text that would start like an internal key (or like an escaped one) gets
# in front: the mapping stays one-to-one, and the key stays readable
CALENDAR_ESCAPE = "%"
# ad-hoc sessions (`gpuresa session start`); and the prefix the previous key format gave
# them, still recognised so that their running sessions are adopted as ad-hoc
AD_HOC_PREFIX = f"{INTERNAL_MARK}adhoc-"
LEGACY_AD_HOC_PREFIX = "adhoc-"


def calendar_key(text: str) -> str:
    """Calendar text (a UID, a file name, an href) made the start of a key.

    Given any text, returns it unchanged unless it is empty or starts with
    INTERNAL_MARK or CALENDAR_ESCAPE, which get CALENDAR_ESCAPE in front.
    So the result never starts with INTERNAL_MARK (no calendar reaches an
    internal key), two texts never give one key, and the keys of ordinary
    UIDs are what they always were (running sessions keep matching).
    """
    if not text or text.startswith((INTERNAL_MARK, CALENDAR_ESCAPE)):
        return CALENDAR_ESCAPE + text
    return text


def bench_key(host: str) -> str:
    """The key `gpuresa bench` journals its runs under: `@bench:<host>`, an internal key."""
    return f"{INTERNAL_MARK}bench:{host}"


def is_ad_hoc(key: str) -> bool:
    """Whether `key` is an internal key (an ad-hoc session), or an ad-hoc key of the
    previous format (`adhoc-…`, which the calendar reader refuses as a UID)."""
    return key.startswith((INTERNAL_MARK, LEGACY_AD_HOC_PREFIX))


def occurrence_key(uid: str, recurrence_id: str | None) -> str:
    """The key of one occurrence: the UID (see `calendar_key`), plus "@" and the
    RECURRENCE-ID for an occurrence of a series."""
    key = calendar_key(uid)
    return key if recurrence_id is None else f"{key}@{recurrence_id}"


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
    # where a scheduler runs it: a node, "partition:<name>" or "" (see SessionSpec.place)
    place: str = ""
    # runs only on GPUs no firm booking needs, and gives them up when one does
    # (`gpuresa.planning.preemption`)
    preemptible: bool = False


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
    # the calendar object (href or file name) it was read from, where known
    href: str = ""

    @classmethod
    def of(cls, reservation: Reservation, reason: str, key: str | None = None) -> Rejection:
        """`reservation` refused for `reason` (under its own key, or `key`)."""
        return cls(
            key=key or reservation.key,
            uid=reservation.uid,
            calendar=reservation.calendar,
            reason=reason,
            user=reservation.user,
            email=reservation.email,
            start=reservation.start,
            end=reservation.end,
            href=reservation.href,
        )


@dataclass(frozen=True)
class ReservationSet:
    """What the calendars ask for over a window: reservations and rejections."""

    reservations: tuple[Reservation, ...] = ()
    rejected: tuple[Rejection, ...] = ()


@dataclass(frozen=True)
class SessionSpec:
    """What a backend needs to create a session; ports and GPUs already chosen."""

    key: str
    user: str
    host: str
    template: str
    cuda: str | None
    # how many GPUs the session gets, and which of the host's (by index) when gpuresa
    # chooses them; () where a scheduler places them (`Capabilities.places_gpus`)
    gpu_count: int
    gpu_indices: tuple[int, ...]
    start: datetime
    end: datetime
    ssh_port: int
    ftp_port: int
    ftp_passive_first: int
    ftp_passive_last: int
    email: str | None = None
    # where a scheduler runs it: a node, "partition:<name>" or "" (any; engines ignore it);
    # a session's: the node the scheduler chose ("" for an engine's session)
    place: str = ""
    # started as a preemptible booking's: it stays one, whatever its booking says later
    preemptible: bool = False


@dataclass(frozen=True)
class IdRange:
    """The host uids and gids a session's user namespace maps ids 0 to count-1 onto."""

    uid: int
    gid: int
    count: int

    def __str__(self) -> str:
        return f"{self.uid}-{self.uid + self.count - 1}"


@dataclass(frozen=True, kw_only=True)
class Session(SessionSpec):
    """A session as its backend shows it: its spec (rebuilt from the containers' `gpuresa.*`
    labels, the backend's records) and what it is now.

    A session *is* its spec with a state: it inherits the spec's fields, so readers
    ask `session.user` as they ask `spec.user`, a session goes wherever a spec does,
    and `Session.of(spec, ...)` makes one without copying the spec field by field.
    """

    # "created" (prepared, not started), "running", or "stopped" (exited, not removed)
    state: str
    output_dir: Path
    ftp_user: str = ""
    ftp_password: str = field(default="", repr=False)
    containers: tuple[str, ...] = ()
    # the host ids of the session's user namespace (None: none, or not known)
    id_range: IdRange | None = None
    # the fingerprint of a host key of the session's own, for an sshd without a certificate
    host_key: str = ""

    @classmethod
    def of(
        cls,
        spec: SessionSpec,
        *,
        state: str,
        output_dir: Path,
        ftp_user: str = "",
        ftp_password: str = "",
        containers: tuple[str, ...] = (),
        id_range: IdRange | None = None,
        host_key: str = "",
    ) -> Session:
        """The session of `spec` (a plain spec, or a session's: its own part is left out)."""
        return cls(
            **_spec_values(spec),
            state=state,
            output_dir=output_dir,
            ftp_user=ftp_user,
            ftp_password=ftp_password,
            containers=containers,
            id_range=id_range,
            host_key=host_key,
        )

    @property
    def spec(self) -> SessionSpec:
        """What this session was made from, without what its backend shows (a plain
        `SessionSpec`, which compares equal to the spec that made it)."""
        return SessionSpec(**_spec_values(self))


def _spec_values(spec: SessionSpec) -> dict[str, Any]:
    return {item.name: getattr(spec, item.name) for item in fields(SessionSpec)}
