"""What one VEVENT asks for, checked: the mapping rules that turn an occurrence into a booking.

Everything in an event is untrusted text typed into a booking form, so every
value a reservation takes from it is checked, and any failure rejects that
occurrence alone, with a reason its user can act on (fail closed):

- **user**: the SUMMARY (`alice`), the local part of the ORGANIZER's or first
  ATTENDEE's e-mail (through `email_logins` first), or the `user` group of
  `summary_regex`; a login, and an allowed user when the site lists them.
- **host**: the calendar's `host`, else the LOCATION (a host name, any case).
- **template, cuda, gpus**: the named groups of `summary_regex`, then the
  `X-GPURESA-TEMPLATE`/`-CUDA`/`-GPUS` properties, then `key: value` lines of
  the DESCRIPTION, then the calendar's defaults. The template and its CUDA
  variant must exist; GPUs are a whole number from 1 to the host's count, or
  `all`.
- **place** (hosts of engine "slurm"): `node: NAME` or `partition: NAME`
  (`X-GPURESA-NODE`/`-PARTITION`, DESCRIPTION lines), a Slurm name; not
  both. Whether the cluster has it, and the GPUs, is the backend's to say.
- **time**: the end after the start; no longer than `reservations.max_duration`.
Pure: `BookingReader` applies them for one calendar, no I/O, no clock.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from datetime import timedelta, tzinfo

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.names import LOGIN
from gpuresa.config.schema import format_duration
from gpuresa.config.sections import Config
from gpuresa.ical.occurrence import Occurrence, Problem
from gpuresa.ical.text import Component, unescape_text
from gpuresa.ical.values import read_stamp
from gpuresa.model import Rejection, Reservation, calendar_key, occurrence_key
from gpuresa.reservations.booking_fields import (
    Booking,
    clean_text,
    description_fields,
    email_address,
    place_of,
    preemptible_of,
    quoted,
)
from gpuresa.reservations.conflicts import host_gpu_count

log = logging.getLogger(__name__)


_LOGIN = re.compile(LOGIN)
_CUDA_PREFIX = re.compile(r"(?i)cuda[\s:=-]*")
_GPU_COUNT = re.compile(r"[0-9]{1,4}")
_SUMMARY_LIMIT = 1000
_UNSAFE_UID = re.compile(r"[\x00-\x1f\x7f/\\]")
# the keys the previous format gave ad-hoc sessions and benches: internal keys now start
# with "@", which no calendar key does (`gpuresa.model.calendar_key`), but sessions and
# journal rows made before may still carry these, so a UID may not take them
_LEGACY_INTERNAL_PREFIXES = ("adhoc-", "bench:")
# "<uid>@<recurrence id>" is the key of a series' occurrence: no single event's UID
_OCCURRENCE_SUFFIX = re.compile(r"@[0-9]{8}(?:T[0-9]{6}Z?)?$")
# what SUMMARY holds, in the words of the app whose admin reads the refusal, for sources
# that write their own objects (X-GPURESA-SUMMARY); only these fixed phrases, so an event
# that sets the property can make its own refusal say nothing else
_SUMMARY_NAMES = {
    "grr-beneficiary": "the booking's beneficiary (GRR's \"beneficiaire\", not its short "
    'description "name")',
}


class BookingReader:
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
        self.bookings: dict[int, Booking] = {}
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
                href=occurrence.href,
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
            place=booking.place,
            preemptible=booking.preemptible,
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

    def booking(self, component: Component, uid: str) -> Booking:
        found = self.bookings.get(id(component))
        if found is None:
            found = self.bookings[id(component)] = self._read_booking(component, uid)
        return found

    def _read_booking(self, component: Component, uid: str) -> Booking:
        """Apply the mapping rules to one VEVENT; every problem found is kept."""
        problems: list[str] = []
        summary = clean_text(component.text("SUMMARY") or "")[:_SUMMARY_LIMIT]
        summary_is = _SUMMARY_NAMES.get((component.text("X-GPURESA-SUMMARY") or "").strip())
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
                    f"{summary_is or 'the title'} {quoted(summary)} does not have the form "
                    "this calendar expects (its summary_regex)"
                )
            else:
                from_regex = {
                    name: value.strip()
                    for name, value in match.groupdict().items()
                    if value is not None and value.strip()
                }
        # what a source refuses whatever the event says (a GRR room booked by periods...)
        problems.extend(
            clean_text(unescape_text(found.value))[:300]
            for found in component.all("X-GPURESA-REFUSED")
        )
        user, email = self._user(component, summary, summary_is, from_regex, problems)
        host = self._host(component, problems)
        fields = self._fields(component, from_regex)
        template, cuda = self._template(fields, problems)
        gpus = self._gpus(fields, host, problems)
        place = place_of(fields, problems)
        preemptible = preemptible_of(fields, self.calendar, self.hosts.get(host or ""), problems)
        status = component.first("STATUS")
        tentative = status is not None and status.value.strip().upper() == "TENTATIVE"
        return Booking(
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
            place=place,
            preemptible=preemptible,
        )

    # --- user -------------------------------------------------------------------------

    def _user(
        self,
        component: Component,
        summary: str,
        summary_is: str | None,
        from_regex: Mapping[str, str],
        problems: list[str],
    ) -> tuple[str | None, str | None]:
        """The login (None when invalid) and the e-mail address that notices go to.

        `summary_is` is what the source calls SUMMARY's text (None: the event's title).
        """
        organizer = email_address(component.first("ORGANIZER"))
        attendee = self._first_attendee(component)
        email = organizer or attendee
        if "user" in from_regex:
            candidate, source = from_regex["user"], summary_is or "the title"
        elif self.calendar.user_from == "summary":
            candidate, source = summary.strip(), summary_is or "the title"
            if not candidate:
                problems.append(
                    f"no user: {summary_is} is empty"
                    if summary_is
                    else "no user: the event has no title (SUMMARY) to read a login from"
                )
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
                f"{quoted(candidate)} (from {source}) is not a login: lower-case letters, "
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
            address = email_address(found)
            if address is not None:
                return address
        return None

    # --- host ---------------------------------------------------------------------------

    def _host(self, component: Component, problems: list[str]) -> str | None:
        known = ", ".join(self.hosts) or "none configured"
        if self.calendar.host is not None:
            return self.calendar.host
        location = clean_text(component.text("LOCATION") or "").strip()
        if not location:
            problems.append(
                "no host: this calendar books no fixed host and the event has no LOCATION "
                f"(hosts: {known})"
            )
            return None
        host = self.hosts_folded.get(location.casefold())
        if host is None:
            problems.append(f"unknown host {quoted(location)} in LOCATION (hosts: {known})")
        return host

    # --- template, CUDA, GPUs ----------------------------------------------------------

    def _fields(self, component: Component, from_regex: Mapping[str, str]) -> dict[str, str]:
        """template/cuda/gpus: regex groups, then X-GPURESA-*, then DESCRIPTION lines."""
        fields = description_fields(component.text("DESCRIPTION") or "")
        for name in ("template", "cuda", "gpus", "node", "partition"):
            value = component.text(f"X-GPURESA-{name.upper()}")
            if value is not None and value.strip():
                fields[name] = clean_text(value).strip()
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
            problems.append(f"unknown template {quoted(asked)} (templates: {known})")
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
                f"CUDA {quoted(asked_cuda)} is not available for template {template!r} "
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
                f"{quoted(asked)} is not a number of GPUs: write a whole number from 1 to "
                f"{upper}, or 'all'"
            )
            return 1
        if wanted < 1:
            problems.append(f"{wanted} GPUs: a booking takes at least 1 GPU")
        elif count is not None and wanted > count:
            problems.append(f"{wanted} GPUs asked, but host {host!r} has {count}")
        return wanted
