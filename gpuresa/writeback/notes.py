"""What the daemon tells the calendars at each change of a booking's state.

`CalendarNotes` is called next to the e-mail notices (`gpuresa.daemon.notices`):
each call composes the state's words (`gpuresa.writeback.wording`), queues
one row in the journal for the booking's calendar when its write-back is on,
wakes the worker (`gpuresa.writeback.worker`) and returns: a journal write,
no network. A calendar with write-back off costs a dictionary lookup. The
same state queued twice is one write (the journal deduplicates by key and
state); a newer state replaces an older one not yet written.

For a mirror calendar, `seen` (after each poll) queues "booked" for bookings
the mirror does not show yet and "cancelled" (the event removed) for those
no longer in the calendar that had not started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, datetime

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.ical.text import DERIVED_UID_PREFIX
from gpuresa.journal.store import Journal
from gpuresa.journal.writeback import WriteBackRow
from gpuresa.mail.notices import OUTPUT_TARGET
from gpuresa.model import Rejection, Reservation, Session, SessionSpec, calendar_key
from gpuresa.outputs.host_ca import HostCA
from gpuresa.outputs.messages import sftp_command
from gpuresa.outputs.records import planned_removal
from gpuresa.writeback import wording
from gpuresa.writeback.standing import write_off_reason
from gpuresa.writeback.wording import CalendarState
from gpuresa.writeback.worker import WriteBackWorker

log = logging.getLogger(__name__)

# mirror rows in these states whose booking left the calendar are removed from the mirror
_CANCELLABLE = frozenset({"booked", "prepared", "refused"})


class CalendarNotes:
    """Queues each booking's state for its calendar; see the module's docstring."""

    def __init__(
        self,
        config: Config,
        journal: Journal,
        worker: WriteBackWorker | None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.config = config
        self.journal = journal
        self.worker = worker
        self.clock = clock
        self._calendars = {
            calendar.name: calendar for calendar in config.calendars if calendar.write_back != "off"
        }

    @property
    def _timezone(self) -> str:
        return self.config.reservations.timezone

    def _public_host(self) -> str:
        host = self.config.host()
        return host.public_name or host.name

    # --- the states ----------------------------------------------------------------------

    def refused(self, rejection: Rejection) -> None:
        """A booking refused, with the reason."""
        if rejection.calendar not in self._calendars:
            return
        href = rejection.href
        if not href:
            found = self.journal.reservations.get(rejection.key)
            href = found.href if found is not None else ""
        own_key = calendar_key(rejection.uid)
        if not href and not (rejection.key == own_key or rejection.key.startswith(own_key + "@")):
            # a refused copy of a UID another object holds: its UID would find the other
            return
        state = wording.refused(
            rejection.reason, rejection.start, self._timezone, series=_series(rejection.key)
        )
        self._queue(
            rejection.key,
            rejection.calendar,
            rejection.uid,
            href,
            rejection.user or "",
            rejection.start,
            rejection.end,
            state,
        )

    def failed(self, key: str, reason: str) -> None:
        """A booking that cannot be served (its start failed for good): refused, with why."""
        reservation = self._reservation(key)
        if reservation is not None:
            self._note(
                reservation,
                wording.refused(reason, reservation.start, self._timezone, series=_series(key)),
            )

    def prepared(self, spec: SessionSpec) -> None:
        """The session is prepared and starts at its booking's start."""
        reservation = self._reservation(spec.key)
        if reservation is not None:
            self._note(
                reservation,
                wording.prepared(
                    self._public_host(),
                    reservation.start,
                    self._timezone,
                    series=_series(spec.key),
                ),
            )

    def running(self, session: Session, public_host: str) -> None:
        """The session runs: the ssh line, the host key to trust, where output goes."""
        reservation = self._reservation(session.key)
        if reservation is None:
            return
        self._note(
            reservation,
            wording.running(
                host=public_host,
                ssh_line=f"ssh -p {session.ssh_port} {session.user}@{public_host}",
                trust_lines=self._trust_line(session),
                end=session.end,
                output_target=OUTPUT_TARGET,
                outputs_command=self._outputs_command(session.user, public_host),
                timezone=self._timezone,
                start=reservation.start,
                series=_series(session.key),
            ),
        )

    def ended(self, session: Session, at: datetime, how: str = "ended") -> None:
        """The session is over (`how`: "ended", "released" or "preempted"); where its
        output is kept, and until when."""
        reservation = self._reservation(session.key)
        if reservation is None:
            return
        public_host = session.place or self._public_host()
        self._note(
            reservation,
            wording.ended(
                host=public_host,
                at=at,
                output_dir=session.output_dir,
                outputs_command=self._outputs_command(session.user, public_host),
                removal=planned_removal(at, self.config.storage),
                timezone=self._timezone,
                how=how,
                start=reservation.start,
                series=_series(session.key),
            ),
        )

    def seen(
        self, reservations: Iterable[Reservation], rejected: Collection[str], fresh: Collection[str]
    ) -> None:
        """After a poll: mirror calendars (read afresh: `fresh`) show each booking of this
        host, and no longer show those that left the calendar before they started."""
        mirrors = [
            name
            for name, calendar in self._calendars.items()
            if calendar.write_back == "mirror" and name in fresh
        ]
        if not mirrors:
            return
        host = self.config.daemon.host
        current: dict[str, Reservation] = {
            reservation.key: reservation
            for reservation in reservations
            if reservation.calendar in mirrors and reservation.host == host
        }
        known = {row.key: row for row in self.journal.writeback.of_calendars(mirrors)}
        for key, reservation in current.items():
            if key not in known:
                self._note(
                    reservation,
                    wording.booked(host, reservation.start, self._timezone, series=_series(key)),
                )
        now = self.clock()
        for key, row in known.items():
            gone = key not in current and key not in rejected
            if gone and row.state in _CANCELLABLE and (row.end is None or row.end > now):
                self._queue(
                    key,
                    row.calendar,
                    row.uid,
                    row.href,
                    row.summary,
                    row.start,
                    row.end,
                    CalendarState("cancelled", "the booking was cancelled", ""),
                )

    # --- helpers -------------------------------------------------------------------------

    def _reservation(self, key: str) -> Reservation | None:
        if not self._calendars:
            return None  # write-back off everywhere: not even a journal read
        found = self.journal.reservations.get(key)
        if found is None or found.calendar not in self._calendars:
            return None
        return found

    def _note(self, reservation: Reservation, state: CalendarState) -> None:
        self._queue(
            reservation.key,
            reservation.calendar,
            reservation.uid,
            reservation.href,
            reservation.user,
            reservation.start,
            reservation.end,
            state,
        )

    def _queue(
        self,
        key: str,
        calendar_name: str,
        uid: str,
        href: str,
        summary: str,
        start: datetime | None,
        end: datetime | None,
        state: CalendarState,
    ) -> None:
        calendar: CalendarConfig | None = self._calendars.get(calendar_name)
        if calendar is None or uid.startswith(DERIVED_UID_PREFIX):
            # an event without UID: its key is made of its text, which a write would change
            return
        if write_off_reason(self.journal, calendar) is not None:
            return
        now = self.clock()
        row = WriteBackRow(
            key=key,
            calendar=calendar_name,
            uid=uid,
            href=href,
            state=state.state,
            detail=state.detail,
            text=state.text,
            summary=summary,
            start=start,
            end=end,
            queued_at=now,
            attempts=0,
            last_error=None,
            next_try=now,
            written_at=None,
        )
        if self.worker is not None:
            self.worker.submit(row)  # journaled by the worker's thread: the caller never waits
        else:
            self.journal.writeback.put(row)

    def _trust_line(self, session: Session) -> str:
        """The session port's `@cert-authority` line, or the session's own key; "" if
        unreadable (the state is written without it rather than not at all)."""
        try:
            host = self.config.host(session.host)
        except UserError:
            host = None
        try:
            if host_capabilities(host).own_host_key:
                return session.host_key
            return HostCA(self.config).known_hosts_line(session.ssh_port)
        except (OSError, ValueError) as error:
            log.error("%s: host key left out of the calendar: %s", session.key, error)
            return ""

    def _outputs_command(self, login: str, public_host: str) -> str:
        if not self.config.storage.sftp_port:
            return ""
        return sftp_command(self.config, login, public_host)


def _series(key: str) -> bool:
    """Whether `key` names an occurrence of a series (`<uid>@<recurrence id>`)."""
    return "@" in key.lstrip("@") and key.rsplit("@", 1)[-1][:8].isdigit()
