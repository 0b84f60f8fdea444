"""Calendar objects to validated reservations: mapping rules, validation, over-booking.

Pure: given the calendars' objects, the config and a window, these functions
return what the calendars ask for; they do no I/O and read no clock (the one
exception: when no template catalog is passed, it is read from the template
folders through `gpuresa.reservations.catalog.template_variants`).

Everything in an event is untrusted text typed into a booking form, so every
value a reservation takes from it is checked, and any failure rejects that
occurrence alone, with a reason its user can act on (fail closed):

- **user**: the SUMMARY (`alice`), the local part of the ORGANIZER's or first
  ATTENDEE's e-mail (through the calendar's `email_logins` table first), or the
  `user` group of the calendar's `summary_regex`; must be a login
  (`^[a-z_][a-z0-9_-]{0,31}$`) and, when the site lists them, an allowed user.
- **host**: the calendar's `host`, else the LOCATION (a configured host name,
  any case).
- **template, cuda, gpus**: the named groups of `summary_regex`, then the
  `X-GPURESA-TEMPLATE`/`-CUDA`/`-GPUS` properties, then `key: value` lines of
  the DESCRIPTION, then the calendar's defaults. The template and its CUDA
  variant must exist; GPUs are a whole number from 1 to the host's count, or
  `all`.
- **time**: the end after the start; no longer than `reservations.max_duration`.

Over-booking is decided across calendars by `resolve_conflicts`: on one host,
a booking whose session is already prepared or running keeps it; between the
others, the one gpuresa saw first (the journal's first sight) wins, then the
UID. CREATED and DTSTAMP do not count: whoever writes the event writes them.
"""

from __future__ import annotations

import contextlib
import gc
import html
import logging
import re
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, tzinfo
from types import MappingProxyType
from zoneinfo import ZoneInfo

from gpuresa.config.schema import format_duration
from gpuresa.config.sections import LOGIN, CalendarConfig, Config, HostConfig
from gpuresa.ical.events import expand
from gpuresa.ical.occurrence import Occurrence, Problem
from gpuresa.ical.text import Component, ParsedObject, parse_object, unescape_text
from gpuresa.ical.values import read_stamp
from gpuresa.ical.window import outside_window
from gpuresa.model import (
    Rejection,
    Reservation,
    ReservationSet,
    calendar_key,
    occurrence_key,
)
from gpuresa.reservations.claims import first_calendars, first_copies, moved_after_end

log = logging.getLogger(__name__)

_LOGIN = re.compile(LOGIN)
_EMAIL = re.compile(r"[^@\s<>(),;:\"\\\[\]]{1,64}@[A-Za-z0-9.-]{1,253}")
_DESCRIPTION_LINE = re.compile(r"\s*([A-Za-z][A-Za-z _-]{0,30}?)\s*[:=]\s*(.*?)\s*")
_HTML_BREAK = re.compile(r"<\s*(?:br|/p|/div|/li|p|div|li)\b[^>]{0,200}>", re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^<>]{0,500}>")
_CUDA_PREFIX = re.compile(r"(?i)cuda[\s:=-]*")
_GPU_COUNT = re.compile(r"[0-9]{1,4}")
# keys of `key: value` lines in DESCRIPTION, as people write them
_DESCRIPTION_KEYS = {"template": "template", "cuda": "cuda", "gpus": "gpus", "gpu": "gpus"}
_KEY_SPELLING = str.maketrans("", "", " \t_-")
_SUMMARY_LIMIT = 1000
_LATEST = datetime.max.replace(tzinfo=UTC)
_NOTHING_SEEN: Mapping[str, datetime] = MappingProxyType({})
_NOTHING_GRANTED: Mapping[str, tuple[datetime, datetime]] = MappingProxyType({})
_UNSAFE_UID = re.compile(r"[\x00-\x1f\x7f/\\]")
# the keys the previous format gave ad-hoc sessions and benches: internal keys now start
# with "@", which no calendar key does (`gpuresa.model.calendar_key`), but sessions and
# journal rows made before may still carry these, so a UID may not take them
_LEGACY_INTERNAL_PREFIXES = ("adhoc-", "bench:")
# "<uid>@<recurrence id>" is the key of a series' occurrence: no single event's UID
_OCCURRENCE_SUFFIX = re.compile(r"@[0-9]{8}(?:T[0-9]{6}Z?)?$")
_NO_ORIGINS: Mapping[str, tuple[str, str]] = MappingProxyType({})
_NO_COUNTS: Mapping[str, int] = MappingProxyType({})


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while calendars are read.

    Reading 10,000 events allocates a few hundred thousand small objects and
    makes no reference cycles, so the collector's passes over the growing
    heap only cost time (about a fifth of the whole, measured). Reference
    counting still frees everything as usual; the collector's state is put
    back as it was, also when this is nested.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def host_gpu_count(host: HostConfig) -> int | None:
    """How many GPUs bookings on `host` may share; None when gpuresa does not count them.

    A list of GPU indices gives the count. `gpus = "auto"` leaves the count to
    the runtime (it asks nvidia-smi on that host), and `gpu_mode = "none"`
    hands no GPU to sessions: for both, None means that a booking's GPU count
    has no upper bound here and over-booking is decided later, by the runtime
    on the host itself.
    """
    if host.gpu_mode == "none" or host.gpus == "auto":
        return None
    return len(host.gpus)


@dataclass(frozen=True)
class _Booking:
    """What one VEVENT asks for, read once for all its occurrences."""

    user: str | None
    email: str | None
    host: str | None
    template: str | None
    cuda: str | None
    gpus: int
    summary: str
    created: datetime | None
    stamp: datetime | None
    tentative: bool
    problems: tuple[str, ...]


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
    reader = _BookingReader(calendar, config, variants, site_zone)
    reservations: list[Reservation] = []
    rejected: list[Rejection] = []
    with _cycle_collection_paused():
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
    reservations.sort(key=_reservation_order)
    rejected.sort(key=_rejection_order)
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


def _reservation_order(reservation: Reservation) -> tuple[datetime, str]:
    return reservation.start, reservation.key


def _rejection_order(rejection: Rejection) -> tuple[datetime, str]:
    return rejection.start or datetime.min.replace(tzinfo=UTC), rejection.key


class _BookingReader:
    """The mapping rules and checks of one calendar, applied to its occurrences."""

    def __init__(
        self,
        calendar: CalendarConfig,
        config: Config,
        variants: Mapping[str, tuple[str, ...]],
        site_zone: tzinfo,
    ) -> None:
        self.calendar = calendar
        self.config = config
        self.variants = variants
        self.site_zone = site_zone
        self.hosts = {host.name: host for host in config.hosts}
        self.hosts_folded = {host.name.casefold(): host.name for host in config.hosts}
        self.templates_folded = {name.casefold(): name for name in variants}
        self.summary_regex = re.compile(calendar.summary_regex) if calendar.summary_regex else None
        self.email_logins = {
            address.casefold(): login for address, login in calendar.email_logins.items()
        }
        self.allowed_users = set(config.reservations.allowed_users)
        self.max_duration = config.reservations.max_duration
        # a series' occurrences share their VEVENT: read it once
        self.bookings: dict[int, _Booking] = {}
        # each UID's series, whose login its overrides may not change
        self.masters: dict[str, Component] = {}

    def occurrence(self, occurrence: Occurrence) -> Reservation | Rejection | None:
        """The reservation one occurrence asks for, its rejection, or None (tentative)."""
        booking = self.booking(occurrence.component, occurrence.uid)
        key = occurrence_key(occurrence.uid, occurrence.recurrence_id)
        if booking.tentative and not self.calendar.accept_tentative:
            log.debug("%s: tentative (awaiting approval), not a reservation yet", key)
            return None
        problems = list(booking.problems)
        master = self.masters.get(occurrence.uid)
        if master is not None and master is not occurrence.component:
            owner = self.booking(master, occurrence.uid).user
            if owner is not None and booking.user != owner:
                problems.append(
                    f"this occurrence names {booking.user or 'another login'}, but the "
                    f"booking is {owner}'s: an occurrence cannot be given to someone else"
                )
        length = occurrence.end - occurrence.start
        if length < timedelta(0):
            problems.append("it ends before it starts")
        elif length == timedelta(0):
            problems.append("it ends when it starts (no end time, or a zero length)")
        elif length > self.max_duration:
            problems.append(
                f"it lasts {format_duration(length)}, longer than the site's maximum of "
                f"{format_duration(self.max_duration)}"
            )
        if problems:
            reason = "; ".join(problems)
            log.debug("%s: rejected: %s", key, reason)
            return Rejection(
                key=key,
                uid=occurrence.uid,
                calendar=self.calendar.name,
                reason=reason,
                user=booking.user,
                email=booking.email,
                start=occurrence.start,
                end=occurrence.end,
                uid_derived=occurrence.component.uid_derived,
            )
        assert booking.host is not None and booking.user is not None
        assert booking.template is not None
        return Reservation(
            key=key,
            uid=occurrence.uid,
            recurrence_id=occurrence.recurrence_id,
            calendar=self.calendar.name,
            host=booking.host,
            user=booking.user,
            template=booking.template,
            cuda=booking.cuda,
            gpus=booking.gpus,
            start=occurrence.start,
            end=occurrence.end,
            email=booking.email,
            summary=booking.summary,
            created=booking.created,
            stamp=booking.stamp,
            tentative=booking.tentative,
            uid_derived=occurrence.component.uid_derived,
            href=occurrence.href,
        )

    def reject_problem(self, problem: Problem) -> Rejection:
        """The rejection of an object, event or occurrence that cannot be read."""
        if problem.uid is not None:
            key = occurrence_key(problem.uid, problem.recurrence_id)
        elif problem.component is not None:
            key = f"{calendar_key(problem.href)}#{problem.component.position}"
        else:
            key = calendar_key(problem.href)
        user = email = None
        if problem.component is not None:
            # who to tell, if the rest of the event says it
            booking = self.booking(problem.component, problem.uid or "")
            user, email = booking.user, booking.email
        log.debug("%s: rejected (%s): %s", key, problem.href, problem.reason)
        return Rejection(
            key=key,
            uid=problem.uid or "",
            calendar=self.calendar.name,
            reason=problem.reason,
            user=user,
            email=email,
            start=problem.start,
            end=problem.end,
            uid_derived=problem.component is not None and problem.component.uid_derived,
        )

    def booking(self, component: Component, uid: str) -> _Booking:
        found = self.bookings.get(id(component))
        if found is None:
            found = self.bookings[id(component)] = self._read_booking(component, uid)
        return found

    def _read_booking(self, component: Component, uid: str) -> _Booking:
        """Apply the mapping rules to one VEVENT; every problem found is kept."""
        problems: list[str] = []
        summary = _clean(component.text("SUMMARY") or "")[:_SUMMARY_LIMIT]
        if uid and (len(uid) > 255 or _UNSAFE_UID.search(uid) or uid in (".", "..")):
            problems.append(
                "the event's UID cannot name a reservation (it has '/', '\\' or control "
                "characters, or is longer than 255)"
            )
        elif uid and (uid.startswith(_LEGACY_INTERNAL_PREFIXES) or _OCCURRENCE_SUFFIX.search(uid)):
            problems.append(
                "the event's UID cannot name a reservation (it starts like a key gpuresa "
                "keeps for itself, or ends like the key of an occurrence of a series)"
            )
        from_regex: dict[str, str] = {}
        if self.summary_regex is not None:
            match = self.summary_regex.search(summary)
            if match is None:
                problems.append(
                    f"the title {_show(summary)} does not have the form this calendar expects "
                    "(its summary_regex)"
                )
            else:
                from_regex = {
                    name: value.strip()
                    for name, value in match.groupdict().items()
                    if value is not None and value.strip()
                }
        # what a source refuses whatever the event says (a GRR room booked by periods...)
        problems.extend(
            _clean(unescape_text(found.value))[:300] for found in component.all("X-GPURESA-REFUSED")
        )
        user, email = self._user(component, summary, from_regex, problems)
        host = self._host(component, problems)
        fields = self._fields(component, from_regex)
        template, cuda = self._template(fields, problems)
        gpus = self._gpus(fields, host, problems)
        status = component.first("STATUS")
        tentative = status is not None and status.value.strip().upper() == "TENTATIVE"
        return _Booking(
            user=user,
            email=email,
            host=host,
            template=template,
            cuda=cuda,
            gpus=gpus,
            summary=summary,
            created=read_stamp(component, "CREATED", self.site_zone),
            stamp=read_stamp(component, "DTSTAMP", self.site_zone),
            tentative=tentative,
            problems=tuple(problems),
        )

    # --- user -------------------------------------------------------------------------

    def _user(
        self,
        component: Component,
        summary: str,
        from_regex: Mapping[str, str],
        problems: list[str],
    ) -> tuple[str | None, str | None]:
        """The login (None when invalid) and the e-mail address that notices go to."""
        organizer = _address(component.first("ORGANIZER"))
        attendee = self._first_attendee(component)
        email = organizer or attendee
        if "user" in from_regex:
            candidate, source = from_regex["user"], "the title"
        elif self.calendar.user_from == "summary":
            candidate, source = summary.strip(), "the title"
            if not candidate:
                problems.append("no user: the event has no title (SUMMARY) to read a login from")
                return None, email
        else:
            address = organizer if self.calendar.user_from == "organizer" else attendee
            what = "ORGANIZER" if self.calendar.user_from == "organizer" else "ATTENDEE"
            if address is None:
                problems.append(f"no user: the event has no {what} with an e-mail address")
                return None, email
            email = address
            source = f"the {what} {address}"
            mapped = self.email_logins.get(address.casefold())
            candidate = mapped or address.rsplit("@", 1)[0].casefold()
        if not _LOGIN.fullmatch(candidate):
            problems.append(
                f"{_show(candidate)} (from {source}) is not a login: lower-case letters, "
                "digits, '_' and '-', starting with a letter or '_', at most 32"
            )
            return None, email
        if self.allowed_users and candidate not in self.allowed_users:
            problems.append(f"user {candidate!r} may not book (not in reservations.allowed_users)")
            return None, email
        return candidate, email

    def _first_attendee(self, component: Component) -> str | None:
        for found in component.all("ATTENDEE"):
            kind = (found.parameter("CUTYPE") or "INDIVIDUAL").upper()
            if kind in ("RESOURCE", "ROOM"):
                continue  # the GPU server itself, invited as a resource
            address = _address(found)
            if address is not None:
                return address
        return None

    # --- host ---------------------------------------------------------------------------

    def _host(self, component: Component, problems: list[str]) -> str | None:
        known = ", ".join(self.hosts) or "none configured"
        if self.calendar.host is not None:
            return self.calendar.host
        location = _clean(component.text("LOCATION") or "").strip()
        if not location:
            problems.append(
                "no host: this calendar books no fixed host and the event has no LOCATION "
                f"(hosts: {known})"
            )
            return None
        host = self.hosts_folded.get(location.casefold())
        if host is None:
            problems.append(f"unknown host {_show(location)} in LOCATION (hosts: {known})")
        return host

    # --- template, CUDA, GPUs ----------------------------------------------------------

    def _fields(self, component: Component, from_regex: Mapping[str, str]) -> dict[str, str]:
        """template/cuda/gpus: regex groups, then X-GPURESA-*, then DESCRIPTION lines."""
        fields = _description_fields(component.text("DESCRIPTION") or "")
        for name in ("template", "cuda", "gpus"):
            value = component.text(f"X-GPURESA-{name.upper()}")
            if value is not None and value.strip():
                fields[name] = _clean(value).strip()
        for name in ("template", "cuda", "gpus"):
            if name in from_regex:
                fields[name] = from_regex[name]
        return fields

    def _template(
        self, fields: Mapping[str, str], problems: list[str]
    ) -> tuple[str | None, str | None]:
        known = ", ".join(sorted(self.variants)) or "none"
        asked = fields.get("template") or self.calendar.default_template
        if asked is None:
            problems.append(
                f"no template: write 'template: NAME' in the description (templates: {known})"
            )
            return None, None
        template = self.templates_folded.get(asked.casefold())
        if template is None:
            problems.append(f"unknown template {_show(asked)} (templates: {known})")
            return None, None
        offered = self.variants[template]
        asked_cuda = fields.get("cuda")
        if asked_cuda is None:
            # the calendar's default when this template has it, else the template's own
            default = self.calendar.default_cuda
            if default is not None and default in offered:
                return template, default
            return template, offered[0] if offered else None
        cuda = _CUDA_PREFIX.sub("", asked_cuda, count=1).strip()
        if cuda not in offered:
            problems.append(
                f"CUDA {_show(asked_cuda)} is not available for template {template!r} "
                f"(choose one of: {', '.join(offered)})"
            )
            return template, None
        return template, cuda

    def _gpus(self, fields: Mapping[str, str], host: str | None, problems: list[str]) -> int:
        count = host_gpu_count(self.hosts[host]) if host in self.hosts else None
        asked = fields.get("gpus")
        if asked is None:
            wanted = self.calendar.default_gpus
        elif asked.strip().casefold() == "all":
            if count is None:
                if host is not None:
                    problems.append(
                        f"'gpus: all' needs host {host!r} to list its GPUs in the config "
                        '(its gpus is "auto" or its gpu_mode is "none"); give a number'
                    )
                return 1
            return count
        elif _GPU_COUNT.fullmatch(asked.strip()):
            wanted = int(asked.strip())
        else:
            upper = f"{count}" if count is not None else "the host's count"
            problems.append(
                f"{_show(asked)} is not a number of GPUs: write a whole number from 1 to "
                f"{upper}, or 'all'"
            )
            return 1
        if wanted < 1:
            problems.append(f"{wanted} GPUs: a booking takes at least 1 GPU")
        elif count is not None and wanted > count:
            problems.append(f"{wanted} GPUs asked, but host {host!r} has {count}")
        return wanted


def _clean(text: str) -> str:
    """Text without control characters (a newline, tab kept), for names and logs."""
    if text.isprintable():
        return text
    return "".join(
        character for character in text if character.isprintable() or character in "\n\t"
    )


def _show(value: str) -> str:
    """A value quoted for a message, shortened."""
    shown = _clean(value).replace("\n", " ")
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return repr(shown)


def _address(found: object) -> str | None:
    """The e-mail address of an ORGANIZER or ATTENDEE (`mailto:` value), if it is one."""
    value = getattr(found, "value", None)
    if not isinstance(value, str):
        return None
    value = value.strip()
    if value[:7].casefold() == "mailto:":
        value = value[7:].strip()
    if len(value) > 254 or not _EMAIL.fullmatch(value):
        return None
    return value


def _description_fields(description: str) -> dict[str, str]:
    """`template: pytorch` / `cuda: 12.4` / `gpus: 2` lines of a DESCRIPTION (first wins).

    Descriptions written by web calendars often carry HTML (`<br>`, `<p>`):
    tags become line breaks or go, entities are decoded.
    """
    if "<" in description:
        description = html.unescape(_HTML_TAG.sub("", _HTML_BREAK.sub("\n", description)))
    fields: dict[str, str] = {}
    for line in description.splitlines():
        match = _DESCRIPTION_LINE.fullmatch(line)
        if match is None:
            continue
        key = _DESCRIPTION_KEYS.get(match[1].translate(_KEY_SPELLING).casefold())
        if key is not None and key not in fields and match[2]:
            fields[key] = _clean(match[2])
    return fields


# --- over-booking -----------------------------------------------------------------------------


def _booking_order(
    reservation: Reservation, first_seen: Mapping[str, datetime], holding: AbstractSet[str]
) -> tuple[object, ...]:
    """Who keeps the GPUs: a booking whose session is prepared or running, then the one
    gpuresa saw first (a key it never saw counts as seen now, the newest), then the UID.

    Not CREATED or DTSTAMP: whoever writes the event writes those too.
    """
    return (
        reservation.key not in holding,
        first_seen.get(reservation.key, _LATEST),
        reservation.uid,
        reservation.start,
        reservation.key,
    )


def _conflict_reason(
    reservation: Reservation,
    winner: Reservation,
    used: int,
    count: int,
    first_seen: Mapping[str, datetime],
    holding: AbstractSet[str],
) -> str:
    """Why `reservation` loses to `winner`, for its user: when the other is, why, the GPU count."""
    if winner.key in holding:
        why = "which already runs"
    elif first_seen.get(winner.key, _LATEST) < first_seen.get(reservation.key, _LATEST):
        why = "which was booked first"
    else:
        why = "which was booked at the same time (the UID decides)"
    # the other booking is someone else's: named by its time only, never by its text or UID
    other = f"{_utc(winner.start)} to {_utc(winner.end)}"
    return (
        f"overlaps another booking on host {reservation.host} from {other} {why}: the host has "
        f"{count} GPU(s) and {used} of them are taken during this time "
        f"(this one asks for {reservation.gpus})"
    )


def _utc(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def resolve_conflicts(
    reservations: Iterable[Reservation],
    config: Config,
    *,
    first_seen: Mapping[str, datetime] = _NOTHING_SEEN,
    holding: AbstractSet[str] = frozenset(),
    granted: Mapping[str, tuple[datetime, datetime]] = _NOTHING_GRANTED,
    granted_gpus: Mapping[str, int] = _NO_COUNTS,
) -> ReservationSet:
    """Decide over-booking: on each host, the bookings with the better claim keep their GPUs.

    Given validated reservations (of any calendars), when gpuresa first saw
    each booking (by key; the journal's `first_seen_times`) and the keys
    whose session is already prepared or running (`holding`), returns those
    that fit, sorted by start then key, and a rejection "overlaps <winner>
    which already runs / which was booked first: …" for each that would make
    overlapping reservations on its host ask for more GPUs than the host has.
    Reservations are taken in `_booking_order`: each is kept if, at every
    instant of its time, it fits with the ones already kept; so extending a
    booking into the slot of a running one never stops the running one.
    Hosts whose GPU count gpuresa does not know (`host_gpu_count` is None)
    keep everything: their runtime decides.

    `granted` holds the interval each prepared, running or ended session was
    given (by key; such a key counts as holding). A booking holds its granted
    time, not its rank: the part of its new times inside that interval comes
    first, the rest (a growth) is weighed after every other booking; a growth
    that does not fit is refused alone (a rejection keyed `<key>/growth`) and
    the booking is kept within its granted time. Shortening is always taken.
    `granted_gpus` holds the GPU count each such session was given: a raise
    of `gpus:` is a growth like a longer time (weighed last, refused alone);
    a lower count is taken, but the granted time still counts the GPUs the
    session holds (a running session keeps the GPUs it started with).
    """
    hosts = {host.name: host for host in config.hosts}
    kept: list[Reservation] = []
    rejected: list[Rejection] = []
    by_host: dict[str, list[Reservation]] = {}
    for reservation in reservations:
        by_host.setdefault(reservation.host, []).append(reservation)
    for host_name, candidates in by_host.items():
        host = hosts.get(host_name)
        count = host_gpu_count(host) if host is not None else None
        if count is None:
            kept.extend(candidates)
            continue
        kept_here = _Timeline()
        # a booking moved wholly out of its granted time holds nothing, like any other,
        # whatever `holding` says: its granted time is what it holds
        holders = {key for key in holding if key not in granted} | {
            item.key
            for item in candidates
            if item.key in granted
            and item.start < granted[item.key][1]
            and granted[item.key][0] < item.end
        }
        candidates.sort(key=lambda item: _booking_order(item, first_seen, holders))
        # what holders were granted comes first; their growth, last
        ordered, growths = _granted_first(candidates, granted, granted_gpus)
        for reservation, counted in ordered:
            if reservation.gpus > count:
                # read_calendar rejects these already; a caller's own list may hold one
                reason = f"{reservation.gpus} GPUs asked, but host {host_name!r} has {count}"
            else:
                blocking = kept_here.blocking(counted, count)
                if blocking is None:
                    kept_here.add(counted)
                    kept.append(reservation)
                    continue
                used, winner = blocking
                reason = _conflict_reason(reservation, winner, used, count, first_seen, holders)
            log.debug("%s: rejected: %s", reservation.key, reason)
            rejected.append(_rejection(reservation, reason))
        for clipped, whole in growths:
            if clipped not in kept:
                continue
            refusal = _grow(clipped, whole, kept_here, count, first_seen, holders)
            if refusal is None:
                kept[kept.index(clipped)] = whole
            else:
                log.debug("%s: growth refused: %s", whole.key, refusal.reason)
                rejected.append(refusal)
    kept.sort(key=_reservation_order)
    rejected.sort(key=_rejection_order)
    return ReservationSet(tuple(kept), tuple(rejected))


def _rejection(reservation: Reservation, reason: str, key: str | None = None) -> Rejection:
    return Rejection(
        key=key or reservation.key,
        uid=reservation.uid,
        calendar=reservation.calendar,
        reason=reason,
        user=reservation.user,
        email=reservation.email,
        start=reservation.start,
        end=reservation.end,
    )


def _granted_first(
    candidates: list[Reservation],
    granted: Mapping[str, tuple[datetime, datetime]],
    granted_gpus: Mapping[str, int],
) -> tuple[list[tuple[Reservation, Reservation]], list[tuple[Reservation, Reservation]]]:
    """The candidates with each holder cut to what it was granted, and the holders that grew.

    Given candidates in `_booking_order`; returns (reservation, counted) for
    each: a booking whose new times meet its granted interval is cut to
    their intersection and to at most its granted GPU count, and counted on
    the timeline with the GPUs its session holds (the granted count, when
    the booking now asks fewer); and (cut, whole) for each whose new times
    or GPU count reach beyond what it was granted. A booking moved wholly
    out of its granted time stays as it is.
    """
    order: list[tuple[Reservation, Reservation]] = []
    growths: list[tuple[Reservation, Reservation]] = []
    for reservation in candidates:
        interval = granted.get(reservation.key)
        start, end = reservation.start, reservation.end
        if interval is not None:
            start, end = max(start, interval[0]), min(end, interval[1])
        if interval is None or start >= end:
            order.append((reservation, reservation))
            continue
        held = granted_gpus.get(reservation.key, reservation.gpus)
        cut = replace(reservation, start=start, end=end, gpus=min(reservation.gpus, held))
        order.append((cut, replace(cut, gpus=max(cut.gpus, held))))
        if cut != reservation:
            growths.append((cut, reservation))
    return order, growths


def _grow(
    cut: Reservation,
    whole: Reservation,
    timeline: _Timeline,
    count: int,
    first_seen: Mapping[str, datetime],
    holders: AbstractSet[str],
) -> Rejection | None:
    """Add what `whole` asks beyond its granted `cut` (more time, more GPUs), or the
    refusal of that growth."""
    parts = [
        replace(whole, start=start, end=end)
        for start, end in ((whole.start, cut.start), (cut.end, whole.end))
        if start < end
    ]
    if whole.gpus > cut.gpus:
        # the GPUs asked beyond the granted count, during the granted time
        parts.append(replace(cut, gpus=whole.gpus - cut.gpus))
    for part in parts:
        blocking = timeline.blocking(part, count)
        if blocking is not None:
            used, winner = blocking
            why = _conflict_reason(part, winner, used, count, first_seen, holders)
            asked = f"{whole.start.isoformat()} – {whole.end.isoformat()}"
            kept = f"{cut.start.isoformat()} – {cut.end.isoformat()}"
            if whole.gpus > cut.gpus:
                asked += f" with {whole.gpus} GPU(s)"
                kept += f" with {cut.gpus} GPU(s)"
            reason = (
                f"the change to {asked} is not taken; the session keeps {kept}, what it "
                f"was given: the change {why}"
            )
            return _rejection(whole, reason, key=f"{whole.key}/growth")
    for part in parts:
        timeline.add(part)
    return None


class _Timeline:
    """The reservations kept on one host, sorted by start, to find overlaps fast.

    They are added in `_booking_order`, so the lower a reservation's index, the
    better its claim.
    """

    def __init__(self) -> None:
        self.starts: list[tuple[datetime, int]] = []
        self.items: list[Reservation] = []
        self.longest = timedelta(0)

    def add(self, reservation: Reservation) -> None:
        insort(self.starts, (reservation.start, len(self.items)))
        self.items.append(reservation)
        self.longest = max(self.longest, reservation.end - reservation.start)

    def blocking(self, reservation: Reservation, count: int) -> tuple[int, Reservation] | None:
        """None if `reservation` fits beside the kept ones; else the most GPUs they use at
        once during its time, and the one with the best claim among those that overlap it."""
        start, end = reservation.start, reservation.end
        low = bisect_left(self.starts, (start - self.longest, -1))
        high = bisect_left(self.starts, (end, -1))
        items = self.items
        overlapping = [index for _, index in self.starts[low:high] if items[index].end > start]
        if not overlapping:
            return None
        # the peak use during this reservation: a sweep over the overlapping ones
        changes: list[tuple[datetime, int]] = []
        for index in overlapping:
            other = items[index]
            changes.append((other.start if other.start > start else start, other.gpus))
            changes.append((other.end if other.end < end else end, -other.gpus))
        changes.sort()  # at one instant, an end (negative) comes before a start
        used = peak = 0
        for _, delta in changes:
            used += delta
            if used > peak:
                peak = used
        if peak + reservation.gpus <= count:
            return None
        return peak, items[min(overlapping)]


def read_reservations(
    config: Config,
    objects_by_calendar: Mapping[str, Iterable[tuple[str, str | bytes]]],
    window_start: datetime,
    window_end: datetime,
    *,
    variants: Mapping[str, tuple[str, ...]] | None = None,
    first_seen: Mapping[str, datetime] = _NOTHING_SEEN,
    holding: AbstractSet[str] = frozenset(),
    granted: Mapping[str, tuple[datetime, datetime]] = _NOTHING_GRANTED,
    ended: Mapping[str, tuple[datetime, datetime]] = _NOTHING_GRANTED,
    origins: Mapping[str, tuple[str, str]] = _NO_ORIGINS,
    granted_gpus: Mapping[str, int] = _NO_COUNTS,
) -> ReservationSet:
    """What all calendars ask for over the window, with over-booking decided.

    Given each configured calendar's objects by calendar name (calendars
    missing from the mapping are skipped), and, for over-booking, when each
    key was first seen and which keys hold a session (see
    `resolve_conflicts`; `granted` and `granted_gpus`: the interval and the
    GPU count each session was given),
    and the times of the bookings whose session ended (`ended`: an ended
    occurrence never runs again; moved, it is a new booking, see
    `gpuresa.reservations.claims.moved_after_end`), returns the kept reservations
    sorted by start then key, and every rejection (unreadable, invalid or
    conflicting). A UID found in two calendars or objects counts once, where
    gpuresa first saw it (`origins`, see `gpuresa.reservations.claims`); every other copy
    is refused with its reason.
    """
    if variants is None:
        from gpuresa.reservations.catalog import template_variants

        variants = template_variants(config)
    with _cycle_collection_paused():
        found = _read_all(config, objects_by_calendar, window_start, window_end, variants, origins)
    found = replace(found, reservations=moved_after_end(found.reservations, ended))
    return _resolve(found, config, first_seen, holding, granted, granted_gpus)


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
    granted: Mapping[str, tuple[datetime, datetime]] = _NOTHING_GRANTED,
    granted_gpus: Mapping[str, int] = _NO_COUNTS,
) -> ReservationSet:
    """`found`'s reservations with over-booking decided; its rejections kept."""
    resolved = resolve_conflicts(
        found.reservations,
        config,
        first_seen=first_seen,
        holding=holding,
        granted=granted,
        granted_gpus=granted_gpus,
    )
    rejected = sorted((*found.rejected, *resolved.rejected), key=_rejection_order)
    return replace(resolved, rejected=tuple(rejected))
