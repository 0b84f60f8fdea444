"""The write-back worker: a thread of its own writes each queued state into its calendar.

Like the e-mail outbox (`gpuresa.mail.outbox`), nothing the daemon does
waits for it: `CalendarNotes` queues a row in the journal (table
`writeback`) and returns; this worker writes what is due, each request with
the calendar's `write_timeout`, so a server that hangs or refuses delays no
start or stop, only the calendar's view. A failed write is tried again after
`RETRY_DELAYS`; one still unwritten a day after its booking ended is given up.

Into the booking's own event ("event"): the worker reads the object (GET,
with its ETag), edits the raw text (`gpuresa.ical.state_block.write_block`:
only gpuresa's block and X-GPURESA-* properties change) and writes it with
`If-Match`. A 412 means the user or the booking app changed the event in
between: the worker reads it again and makes its edit again on the new copy
(the user's edit wins: nothing of theirs is overwritten), a few times at
most before trying later. An event that is gone, or no longer has the UID,
is left alone. Into a mirror ("mirror"): one object per booking, written
whole, and removed when the booking is cancelled; the collection is made
(MKCALENDAR) when missing.

A 401 or 403 is permanent: it is logged once as an error, the calendar's
write-back is off (the journal fact `writeback-off:<calendar>`, with the
reason) until its configuration changes, and its queued rows are given up.
At start, the worker also asks each server whether the account may write
(DAV:current-user-privilege-set) and turns write-back off the same way when
it may not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.sections import Config
from gpuresa.ical.state_block import write_block
from gpuresa.journal.store import Journal
from gpuresa.journal.writeback import WriteBackRow
from gpuresa.mail.outbox import retry_delay
from gpuresa.reservations.sources.caldav_write import (
    Account,
    CalDAVWriter,
    ObjectRefused,
    WriteConflict,
    WriteError,
    WriteFailed,
    WriteRefused,
)
from gpuresa.writeback.mirror import mirror_event, mirror_name
from gpuresa.writeback.standing import (
    OFF_FACT,
    event_account,
    fingerprint,
    mirror_account,
    write_off_reason,
)

log = logging.getLogger(__name__)

# how often a write races an edit before it waits for its next try
CONFLICT_ATTEMPTS = 3
# a row still unwritten this long after its booking's end (or its queuing) is given up
GIVE_UP_AFTER = timedelta(days=1)
LONGEST_NAP = 60.0

WriterFactory = Callable[[Account, float], CalDAVWriter]


def utc_now() -> datetime:
    return datetime.now(UTC)


class WriteBackWorker:
    """Writes the queued states into their calendars, on a thread of its own.

    Given the config (replaced after a reload with `set_config`), the journal
    that holds the queue, a clock and how to make a writer (tests give a
    factory; the default is `CalDAVWriter`). Nothing is written before `start()`.
    """

    def __init__(
        self,
        config: Config,
        journal: Journal,
        clock: Callable[[], datetime] = utc_now,
        writer_factory: WriterFactory = CalDAVWriter,
    ) -> None:
        self.journal = journal
        self.clock = clock
        self._writer_factory = writer_factory
        self._config = config
        self._writers: dict[tuple[str, str], CalDAVWriter] = {}
        self._checked: set[tuple[str, str]] = set()
        self._unanswered: set[tuple[str, str]] = set()
        # rows submitted and not journaled yet, oldest first
        self._incoming: list[WriteBackRow] = []
        self._forgot_at: datetime | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # --- what the daemon calls ---------------------------------------------------------

    def set_config(self, config: Config) -> None:
        """Write with `config` from now on (a reload): new writers, rights checked again."""
        with self._lock:
            self._config = config
            self._writers.clear()
            self._checked.clear()
        self._wake.set()

    def wake(self) -> None:
        """Look for due writes now."""
        self._wake.set()

    def submit(self, row: WriteBackRow) -> None:
        """Queue `row`: kept in memory and journaled by the worker's thread, so the caller
        (the loop, a start) pays no journal write; returns at once."""
        with self._lock:
            self._incoming.append(row)
        self._wake.set()

    def start(self) -> None:
        """Start the worker thread (a daemon thread); nothing happens if it runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gpuresa-writeback", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the worker to stop and wait at most `timeout` seconds (a request under way
        ends within its timeout; the thread never holds up the process's exit)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._journal_incoming()  # what was submitted is written after the next start

    def run_once(self) -> None:
        """Check rights and write everything due now, on the caller's thread (tests, tools)."""
        self._journal_incoming()
        self._check_rights()
        for row in self.journal.writeback.due(self.clock()):
            self._write(row)

    # --- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                self._journal_incoming()
                self._forget_old()
                self._check_rights()
                for row in self.journal.writeback.due(self.clock()):
                    if self._stopping.is_set():
                        return
                    self._write(row)
            except Exception:  # a bug here must not end every later write
                log.exception("calendar write-back failed; trying again shortly")
            self._wake.wait(self._nap())

    def _forget_old(self) -> None:
        """Once an hour: forget the rows of bookings past the journal's retention."""
        now = self.clock()
        if self._forgot_at is not None and now - self._forgot_at < timedelta(hours=1):
            return
        self._forgot_at = now
        with self._lock:
            retention = self._config.daemon.journal_retention
        self.journal.writeback.forget_before(now - retention)

    def _journal_incoming(self) -> None:
        """Journal the submitted rows (the same state twice is one row: `put` says so)."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for row in incoming:
            self.journal.writeback.put(row)

    def _nap(self) -> float:
        soonest = self.journal.writeback.soonest()
        if soonest is None:
            return LONGEST_NAP
        return min(max((soonest - self.clock()).total_seconds(), 0.0), LONGEST_NAP)

    def _calendars(self) -> dict[str, CalendarConfig]:
        with self._lock:
            return {calendar.name: calendar for calendar in self._config.calendars}

    def _check_rights(self) -> None:
        """Once per configuration: may the account write where write-back is on?"""
        for calendar in self._calendars().values():
            if calendar.write_back == "off" or write_off_reason(self.journal, calendar):
                continue
            writer = self._writer(calendar)
            check = (calendar.name, writer.url)
            if check in self._checked:
                continue
            try:
                if calendar.write_back == "mirror":
                    writer.ensure_collection()
                problem = writer.write_problem()
            except WriteRefused as error:
                problem = str(error)
            except WriteError as error:
                # the server is away: checked again later, said once
                level = logging.DEBUG if check in self._unanswered else logging.WARNING
                log.log(level, "calendar %s: write rights not checked: %s", calendar.name, error)
                self._unanswered.add(check)
                continue
            self._checked.add(check)
            if problem is not None:
                self._turn_off(calendar, problem)

    def _writer(self, calendar: CalendarConfig) -> CalDAVWriter:
        account = (
            mirror_account(calendar) if calendar.write_back == "mirror" else event_account(calendar)
        )
        key = (calendar.name, account.url)
        with self._lock:
            writer = self._writers.get(key)
            if writer is None:
                timeout = calendar.write_timeout.total_seconds()
                writer = self._writers[key] = self._writer_factory(account, timeout)
            return writer

    def _turn_off(self, calendar: CalendarConfig, reason: str) -> None:
        """A permanent refusal: reported once, write-back off until the config changes."""
        log.error(
            "calendar %s: write-back is off until its configuration changes: %s",
            calendar.name,
            reason,
        )
        self.journal.facts.set(OFF_FACT + calendar.name, f"{fingerprint(calendar)}\t{reason}")

    # --- one row -----------------------------------------------------------------------

    def _write(self, row: WriteBackRow) -> None:
        now = self.clock()
        calendar = self._calendars().get(row.calendar)
        if calendar is None or calendar.write_back == "off":
            self.journal.writeback.give_up(row.key, row.queued_at, now, "write-back is off")
            return
        off = write_off_reason(self.journal, calendar)
        if off is not None:
            self.journal.writeback.give_up(
                row.key, row.queued_at, now, f"write-back of {calendar.name} is off: {off}"
            )
            return
        if row.attempts and now - max(row.end or row.queued_at, row.queued_at) > GIVE_UP_AFTER:
            self.journal.writeback.give_up(
                row.key, row.queued_at, now, f"not written in time: {row.last_error or '?'}"
            )
            return
        try:
            if calendar.write_back == "mirror":
                self._write_mirror(calendar, row)
            else:
                self._write_event(calendar, row)
        except WriteRefused as error:
            self._turn_off(calendar, str(error))
            self.journal.writeback.give_up(row.key, row.queued_at, now, str(error))
        except ObjectRefused as error:
            log.warning("%s: calendar write-back refused for this event: %s", row.key, error)
            self.journal.writeback.give_up(row.key, row.queued_at, now, str(error))
        except WriteError as error:
            delay = retry_delay(row.attempts + 1)
            log.warning(
                "%s: calendar write-back failed (attempt %d; next in %ss): %s",
                row.key,
                row.attempts + 1,
                int(delay.total_seconds()),
                error,
            )
            self.journal.writeback.mark_failed(row.key, row.queued_at, str(error), now + delay)
        else:
            self.journal.writeback.mark_written(row.key, row.queued_at, self.clock())
            log.debug("%s: calendar shows %s", row.key, row.state)

    def _write_event(self, calendar: CalendarConfig, row: WriteBackRow) -> None:
        """The state into the booking's own event: read, edit gpuresa's part, write if
        unchanged since the read; on a race, again from the new copy."""
        writer = self._writer(calendar)
        # a booking refused before it was ever recorded: its object found by its UID (a
        # search that also finds UIDs containing it: only the one equal to it is written)
        for href in [row.href] if row.href else writer.find(row.uid):
            if self._write_into(writer, href, row):
                return

    def _write_into(self, writer: CalDAVWriter, href: str, row: WriteBackRow) -> bool:
        """Write the state into the object at `href` if it holds the booking's event;
        whether it does (or did: gone, nothing to show the state in)."""
        for _ in range(CONFLICT_ATTEMPTS):
            fetched = writer.get(href)
            if fetched is None:
                return True  # the event is gone: nothing to show the state in
            edited = write_block(fetched.data, row.uid, row.state, row.detail, row.text)
            if edited is None:
                return False  # not (or no longer) this booking's event
            if edited == fetched.data:
                return True  # it already says this
            if fetched.etag is None:
                raise WriteFailed("the server gives no ETag: gpuresa writes only conditionally")
            try:
                writer.put(href, edited, fetched.etag)
            except WriteConflict:
                # edited meanwhile by its user or the booking app: their edit wins
                log.info("%s: the event changed while gpuresa wrote; reading it again", row.key)
                continue
            return True
        raise WriteFailed(f"the event changed {CONFLICT_ATTEMPTS} times while gpuresa wrote")

    def _write_mirror(self, calendar: CalendarConfig, row: WriteBackRow) -> None:
        """The booking's own event in the mirror: written whole, removed when cancelled."""
        writer = self._writer(calendar)
        name = mirror_name(row.key)
        if row.state == "cancelled":
            writer.delete(name)
            return
        data = mirror_event(row)
        if data is None:
            return
        for _ in range(CONFLICT_ATTEMPTS):
            fetched = writer.get(name)
            if fetched is not None and fetched.etag is None:
                raise WriteFailed("the server gives no ETag: gpuresa writes only conditionally")
            try:
                writer.put(name, data, fetched.etag if fetched is not None else None)
            except WriteConflict:
                continue
            return
        raise WriteFailed(f"the mirror's event changed {CONFLICT_ATTEMPTS} times meanwhile")
