"""The outbox: notices are journaled, then e-mailed by a thread of their own.

Sending e-mail inline would let a relay that accepts the connection and never
answers hold the daemon for the SMTP timeout at every notice. Instead
`Outbox.enqueue` writes the message to the journal (table `outbox`) and
returns at once; the outbox's worker thread sends what is due through the
`Notifier` and marks each message sent right after the relay accepted it, in
the same thread, so a restarted daemon resends only what was never accepted
(a crash between the relay's "250" and that mark is the one case in which a
message goes out twice). A message that fails is tried again after
`RETRY_DELAYS` (then every last one) and shows its error in
`gpuresa status`; one still unsent `notify.give_up_after` after it was
queued is dropped, with an error in the log and in its key's history.

Notices are deduplicated by (key, kind): "start", "end",
"warning-900-<end>"…; a kind of None is never deduplicated. When the journal
cannot store a message (a full disk), it is kept in memory and sent all the
same, only not across a restart.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gpuresa.config.schema import format_duration
from gpuresa.journal.outbox import OutboxMessage
from gpuresa.journal.store import Journal
from gpuresa.mail.smtp import Notifier, NotifyError, valid_address
from gpuresa.mail.wording import one_line

log = logging.getLogger(__name__)

# after the first failure, the second, …; then every last one
RETRY_DELAYS = (
    timedelta(seconds=15),
    timedelta(minutes=1),
    timedelta(minutes=5),
    timedelta(minutes=15),
    timedelta(minutes=30),
)
# the worker looks at the journal at least this often (another process may add messages)
LONGEST_NAP = 60.0


def utc_now() -> datetime:
    return datetime.now(UTC)


def retry_delay(attempts: int) -> timedelta:
    """How long to wait after the `attempts`-th failed attempt (1 for the first)."""
    return RETRY_DELAYS[min(max(attempts, 1), len(RETRY_DELAYS)) - 1]


class Outbox:
    """E-mail notices, queued in the journal and sent by a worker thread with back-off.

    Given the journal that stores the queue, the SMTP gateway (replaced
    after a config reload with `set_notifier`) and a clock. Nothing is sent
    before `start()`; messages queued meanwhile wait in the journal.
    """

    def __init__(
        self, journal: Journal, notifier: Notifier, clock: Callable[[], datetime] = utc_now
    ) -> None:
        self.journal = journal
        self.clock = clock
        self._notifier = notifier
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # messages the journal could not store: sent from memory, negative ids
        self._held: dict[int, OutboxMessage] = {}
        self._held_kinds: set[tuple[str, str]] = set()
        self._held_sent: set[tuple[str, str]] = set()
        self._next_held_id = -1

    # --- what the daemon calls ---------------------------------------------------------

    def enqueue(
        self,
        key: str,
        kind: str | None,
        address: str,
        subject: str,
        body: str,
        *,
        copy_admin: bool = False,
    ) -> bool:
        """Queue one e-mail to `address` about reservation `key`; returns at once.

        `kind` names the notice for deduplication ("start", "end",
        "warning-900-<end iso>"…): returns False, queuing nothing, when
        (`key`, `kind`) was queued or sent before, also by an earlier daemon.
        None is never deduplicated. Never raises for a journal failure: the
        message is then kept in memory.
        """
        now = self.clock()
        queued: bool | None
        try:
            queued = self.journal.outbox.add(key, kind, address, subject, body, copy_admin, now)
        except sqlite3.Error as error:
            log.error("%s: cannot journal an e-mail (%s)", key, error)
            queued = None
        if queued is None:
            # not stored (a guarded journal says so with None): sent from memory
            log.error("%s: an e-mail the journal could not store is kept in memory", key)
            queued = self._hold(key, kind, address, subject, body, copy_admin, now)
        if queued:
            self._wake.set()
        return queued

    def set_notifier(self, notifier: Notifier) -> None:
        """Send through `notifier` from now on (after a config reload)."""
        self._notifier = notifier
        self._wake.set()

    def start(self) -> None:
        """Start the worker thread (a daemon thread); nothing happens if it runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gpuresa-outbox", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the worker to stop and wait for it at most `timeout` seconds.

        A send in progress is not interrupted: it ends within the SMTP
        timeout and is marked as usual (the thread is a daemon thread, so it
        never holds up the process's exit).
        """
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Look for due messages now (after the clock moved, or a relay came back)."""
        self._wake.set()

    def backlog(self) -> int:
        """How many messages wait to be sent."""
        try:
            waiting, _ = self.journal.outbox.backlog()
        except sqlite3.Error as error:
            log.error("cannot read the outbox (%s)", error)
            waiting = 0
        with self._lock:
            return waiting + len(self._held)

    def pending(self) -> list[OutboxMessage]:
        """The messages waiting to be sent, oldest first, with their attempts and last error."""
        try:
            waiting = self.journal.outbox.unsent()
        except sqlite3.Error as error:
            log.error("cannot read the outbox (%s)", error)
            waiting = []
        with self._lock:
            waiting.extend(self._held.values())
        return sorted(waiting, key=lambda message: (message.queued_at, message.id))

    def sent(self, key: str, kind: str) -> bool:
        """Whether the notice (`key`, `kind`) was sent (by this daemon or an earlier one)."""
        with self._lock:
            if (key, kind) in self._held_sent:
                return True
        try:
            return self.journal.notices.was_sent(key, kind)
        except sqlite3.Error as error:
            log.error("%s: cannot read the outbox (%s)", key, error)
            return False

    # --- the worker --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                self._send_due()
            except Exception:  # a bug here must not end the sending of every later notice
                log.exception("the outbox failed; trying again shortly")
            self._wake.wait(self._nap())

    def _nap(self) -> float:
        """Seconds until the soonest next try (at most `LONGEST_NAP`)."""
        soonest: datetime | None
        try:
            _, soonest = self.journal.outbox.backlog()
        except sqlite3.Error:
            soonest = None
        with self._lock:
            held = [message.next_try for message in self._held.values()]
        candidates = [instant for instant in (soonest, *held) if instant is not None]
        if not candidates:
            return LONGEST_NAP
        seconds = (min(candidates) - self.clock()).total_seconds()
        return min(max(seconds, 0.0), LONGEST_NAP)

    def _due(self, now: datetime) -> list[OutboxMessage]:
        try:
            due = self.journal.outbox.unsent(due_by=now)
        except sqlite3.Error as error:
            log.error("cannot read the outbox (%s); sending what is kept in memory", error)
            due = []
        with self._lock:
            due.extend(message for message in self._held.values() if message.next_try <= now)
        return due

    def _send_due(self) -> None:
        for message in self._due(self.clock()):
            if self._stopping.is_set():
                return
            self._send(message)

    def _send(self, message: OutboxMessage) -> None:
        notifier = self._notifier
        now = self.clock()
        give_up_after = notifier.config.give_up_after
        if now - message.queued_at > give_up_after:
            self._drop(
                message,
                now,
                f"not sent within {format_duration(give_up_after)} (notify.give_up_after): "
                f"{message.last_error or 'never tried'}",
            )
            return
        if valid_address(message.address) is None:
            # no retry can make it valid
            self._drop(message, now, f"not a valid e-mail address: {one_line(message.address)}")
            return
        try:
            notifier.send(
                message.address,
                message.subject,
                message.body,
                copy_admin=message.copy_admin,
                key=message.key,
            )
        except NotifyError as error:
            self._failed(message, str(error))
            return
        except Exception as error:  # a bug in composing one message must not stop the others
            log.exception("%s: sending an e-mail failed unexpectedly", message.key)
            self._failed(message, f"unexpected error: {one_line(str(error))}")
            return
        self._mark_sent(message)

    def _mark_sent(self, message: OutboxMessage) -> None:
        if message.id < 0:
            with self._lock:
                self._held.pop(message.id, None)
                if message.kind is not None:
                    self._held_sent.add((message.key, message.kind))
            return
        try:
            self.journal.outbox.mark_sent(message.id, self.clock())
        except sqlite3.Error as error:
            # the relay has it; only a restart before the journal recovers resends it
            log.error("%s: e-mail sent but not journaled (%s)", message.key, error)

    def _failed(self, message: OutboxMessage, error: str) -> None:
        attempts = message.attempts + 1
        delay = retry_delay(attempts)
        next_try = self.clock() + delay
        log.warning(
            "%s: e-mail %r to %s failed (attempt %d; next in %s): %s",
            message.key,
            one_line(message.subject, 100),
            message.address,
            attempts,
            format_duration(delay),
            error,
        )
        if message.id < 0:
            with self._lock:
                if message.id in self._held:
                    self._held[message.id] = replace(
                        message, attempts=attempts, last_error=error, next_try=next_try
                    )
            return
        try:
            self.journal.outbox.mark_failed(message.id, error, next_try)
        except sqlite3.Error as journal_error:
            log.error("%s: cannot journal a failed e-mail (%s)", message.key, journal_error)

    def _drop(self, message: OutboxMessage, now: datetime, reason: str) -> None:
        log.error(
            "%s: e-mail %r to %s dropped: %s",
            message.key,
            one_line(message.subject, 100),
            message.address,
            reason,
        )
        if message.id < 0:
            with self._lock:
                self._held.pop(message.id, None)
            return
        try:
            self.journal.outbox.drop(message.id, now, reason)
        except sqlite3.Error as error:
            log.error("%s: cannot journal a dropped e-mail (%s)", message.key, error)

    def _hold(
        self,
        key: str,
        kind: str | None,
        address: str,
        subject: str,
        body: str,
        copy_admin: bool,
        now: datetime,
    ) -> bool:
        with self._lock:
            if kind is not None:
                if (key, kind) in self._held_kinds:
                    return False
                self._held_kinds.add((key, kind))
            message_id = self._next_held_id
            self._next_held_id -= 1
            self._held[message_id] = OutboxMessage(
                id=message_id,
                key=key,
                kind=kind,
                address=address,
                subject=subject,
                body=body,
                copy_admin=copy_admin,
                queued_at=now,
                attempts=0,
                last_error=None,
                next_try=now,
                sent_at=None,
            )
        return True
