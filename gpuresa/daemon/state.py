"""The daemon's gateways for one configuration: calendars, Docker, journal, notices.

A reload makes a new `Context` from the new configuration; actions already
under way finish with the one they began with. The journal and the outbox
outlive reloads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime

from gpuresa.backends.engines.output_service import OutputService
from gpuresa.backends.factory import open_backend
from gpuresa.config.sections import Config
from gpuresa.daemon.memory import RELEASED
from gpuresa.daemon.notices import Notices
from gpuresa.daemon.output_duties import OutputDuties
from gpuresa.daemon.work import Work
from gpuresa.fairshare.history import used_bookings
from gpuresa.journal.store import Journal
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Rejection, Reservation
from gpuresa.reservations.calendars import CalendarReport, Calendars
from gpuresa.reservations.claims import Claims
from gpuresa.sessions.protocol import SessionBackend
from gpuresa.writeback.notes import CalendarNotes
from gpuresa.writeback.worker import WriteBackWorker

log = logging.getLogger(__name__)

# Journal states of bookings that have (or had) their session, which keep their slot.
HELD_STATES = frozenset({"preparing", "running", "warned", "stopping", "ended"})
# The journal's note of a booking seen preemptible (`preemptible:<key>`: when first seen).
PREEMPTIBLE_FACT = "preemptible:"


def utc_now() -> datetime:
    return datetime.now(UTC)


class Context:
    """Config, clock and gateways, as the loop and the workers use them."""

    def __init__(
        self,
        config: Config,
        journal: Journal,
        outbox: Outbox,
        *,
        runtime: SessionBackend | None = None,
        clock: Callable[[], datetime] = utc_now,
        writeback: WriteBackWorker | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.journal = journal
        self.outbox = outbox
        # the session backend of this host (`backends.factory`): the daemon knows its protocol alone
        self.runtime = runtime or open_backend(config)
        self.calendars = Calendars(config)
        self.notifier = Notifier(config.notify, config.users)
        # each state also written into its calendar (where on), by `writeback`'s thread
        self.calendar_notes = CalendarNotes(config, journal, writeback, clock)
        self.notices = Notices(config, self.notifier, outbox, self.calendar_notes)
        self.work = Work(config, self.runtime, journal, self.notices)
        self.outputs = OutputDuties(OutputService(config, self.runtime))

    def public_host(self) -> str:
        host = self.config.host()
        return host.public_name or host.name

    def poll(
        self,
        now: datetime,
        holding: Mapping[str, tuple[datetime, datetime]],
        holding_gpus: Mapping[str, int] | None = None,
    ) -> tuple[CalendarReport, list[Rejection]]:
        """Read the calendars and journal what they say (on the poll thread).

        `holding`: the interval each prepared or running session was given
        (by key), and `holding_gpus` its GPU count, which it keeps in an
        over-booking whatever its booking now says. Returns the report and
        the rejections that are new (or have a new reason), whose users are
        told.
        """
        host = self.config.daemon.host
        # a booking that had its session keeps its slot after the session too: the one it
        # beat must not start for the rest of the time, nor its user be told it lost late
        journal = self.journal
        held = {key for key, state in journal.states.all().items() if state in HELD_STATES}
        recent = now - self.config.reservations.window_past
        rows = [row for row in journal.reservations.all(ending_after=recent) if row.key in held]
        granted = {row.key: (row.start, row.end) for row in rows}
        granted.update(holding)
        granted_gpus = {row.key: row.gpus for row in rows}
        granted_gpus.update(holding_gpus or {})
        preemptible = journal.facts.with_prefix(PREEMPTIBLE_FACT)
        # a booking released for want of a login claims its GPUs no more, like a
        # preemptible one: a walk-in may take them for the rest of its time
        released = journal.facts.with_prefix(RELEASED)
        claims = Claims(
            granted=granted,
            granted_gpus=granted_gpus,
            ended=journal.reservations.ended_times(),
            origins=journal.reservations.origins(),
            preemptible=frozenset(preemptible) | frozenset(released),
        )
        first_seen = journal.reservations.first_seen_times()
        report = self.calendars.poll(
            now,
            first_seen=first_seen,
            holding=frozenset(held | holding.keys()),
            claims=claims,
            used=used_bookings(journal, self.config, now),
        )
        found = report.reservations
        _remember_preemptible(journal, found.reservations, preemptible, first_seen, now)
        new_rejections = self.journal.reservations.record(found.reservations, found.rejected, now)
        for reservation in found.reservations:
            if reservation.host == host and self.journal.states.get(reservation.key) in (
                None,
                "rejected",
            ):
                self.journal.states.set(reservation.key, "booked", now)
        for name, freshness in report.freshness.items():
            self.journal.calendars.record(name, freshness.last_success, freshness.last_error, now)
        fresh = {name for name, freshness in report.freshness.items() if not freshness.last_error}
        self.calendar_notes.seen(
            found.reservations, {rejection.key for rejection in found.rejected}, fresh
        )
        return report, new_rejections

    def reject(self, rejection: Rejection) -> None:
        """Journal a rejection and tell its user, once per reason (on the loop)."""
        config = self.config
        calendar = next(
            (item for item in config.calendars if item.name == rejection.calendar), None
        )
        if calendar is not None and calendar.host not in (None, config.daemon.host):
            return  # that host's daemon tells the user
        # a calendar whose events name their host (LOCATION) is read by every host's
        # daemon: the first host in the config speaks for all, so users get one e-mail
        speaks_for_all = not config.hosts or config.daemon.host == config.hosts[0].name
        self.journal.states.set(rejection.key, "rejected", self.clock(), rejection.reason)
        if calendar is not None and calendar.host is None and not speaks_for_all:
            return
        log.warning("%s: rejected: %s", rejection.key, rejection.reason)
        self.notices.rejected(rejection)


def _remember_preemptible(
    journal: Journal,
    reservations: Iterable[Reservation],
    known: Mapping[str, str],
    first_seen: Mapping[str, datetime],
    now: datetime,
) -> None:
    """Note each booking seen preemptible, which stays so as long as the journal keeps its
    first sighting (its rank in an over-booking): gone for a poll or for a week, it comes
    back preemptible."""
    seen = {reservation.key for reservation in reservations if reservation.preemptible}
    for key in seen - set(known):
        journal.facts.set(PREEMPTIBLE_FACT + key, now.isoformat())
    for key in set(known) - seen - set(first_seen):
        journal.facts.delete(PREEMPTIBLE_FACT + key)
