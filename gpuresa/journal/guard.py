"""The journal as the daemon uses it: it never keeps a session from ending.

A full disk, a damaged file or a database that vanished must not stop the
daemon from stopping sessions at their end: it acts on Docker first and
records what it can. So:

- `GuardedJournal` logs a failed read or write and returns a fallback (an
  empty result, None, False) instead of raising. The outbox's own calls are
  not guarded: the outbox must know that a message could not be stored, to
  keep it in memory.
- `open_journal` moves a journal that cannot be used aside
  (`journal.sqlite.damaged-<UTC stamp>`, with its -wal and -shm) and starts a
  fresh one, and says so, so the daemon can tell the admin. A journal
  written by a newer gpuresa is refused, never moved: its data is not ours
  to throw away. When no file can be written at all, the daemon still runs,
  on a journal in memory.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from gpuresa.errors import UserError
from gpuresa.journal.history import HistoryEntry
from gpuresa.journal.reservation_records import RejectionRecord
from gpuresa.journal.store import (
    COMPANIONS,
    CalendarStatus,
    Journal,
    JournalTooNew,
    JournalUnusable,
)
from gpuresa.model import Rejection, Reservation

log = logging.getLogger(__name__)

Result = TypeVar("Result")


def _best_effort(what: str, call: Callable[[], Result], fallback: Result) -> Result:
    try:
        return call()
    except (sqlite3.Error, ValueError) as error:
        # ValueError: a stored instant that no longer reads (a damaged row)
        log.error("journal %s failed (%s); going on without it", what, error)
        return fallback


class GuardedJournal(Journal):
    """The journal, with reads and writes that log their failure instead of raising.

    Each method falls back to what lets the daemon go on: reads to an empty
    result or None, writes to nothing. `mark_notified` falls back to True: a
    notice whose claim cannot be recorded is sent (twice is better than never).
    """

    def record_reservations(
        self, reservations: Iterable[Reservation], rejected: Iterable[Rejection], now: datetime
    ) -> list[Rejection]:
        return _best_effort(
            "write",
            lambda: super(GuardedJournal, self).record_reservations(reservations, rejected, now),
            [],
        )

    def reservation(self, key: str) -> Reservation | None:
        return _best_effort("read", lambda: super(GuardedJournal, self).reservation(key), None)

    def reservations(self, ending_after: datetime | None = None) -> list[Reservation]:
        return _best_effort(
            "read", lambda: super(GuardedJournal, self).reservations(ending_after), []
        )

    def rejections(self, ending_after: datetime | None = None) -> list[RejectionRecord]:
        return _best_effort(
            "read", lambda: super(GuardedJournal, self).rejections(ending_after), []
        )

    def first_seen_times(self) -> dict[str, datetime]:
        return _best_effort("read", lambda: super(GuardedJournal, self).first_seen_times(), {})

    def state(self, key: str) -> str | None:
        return _best_effort("read", lambda: super(GuardedJournal, self).state(key), None)

    def states(self) -> dict[str, str]:
        return _best_effort("read", lambda: super(GuardedJournal, self).states(), {})

    def state_since(self, key: str) -> datetime | None:
        return _best_effort("read", lambda: super(GuardedJournal, self).state_since(key), None)

    def set_state(self, key: str, state: str, now: datetime, detail: str = "") -> bool:
        return _best_effort(
            "write", lambda: super(GuardedJournal, self).set_state(key, state, now, detail), False
        )

    def record_action(
        self, key: str, action: str, now: datetime, result: str, error: str | None = None
    ) -> None:
        _best_effort(
            "write",
            lambda: super(GuardedJournal, self).record_action(key, action, now, result, error),
            None,
        )

    def mark_notified(self, key: str, kind: str, now: datetime) -> bool:
        return _best_effort(
            "write", lambda: super(GuardedJournal, self).mark_notified(key, kind, now), True
        )

    def unmark_notified(self, key: str, kind: str) -> None:
        _best_effort("write", lambda: super(GuardedJournal, self).unmark_notified(key, kind), None)

    def notified(self, key: str) -> dict[str, datetime]:
        return _best_effort("read", lambda: super(GuardedJournal, self).notified(key), {})

    def was_notified(self, key: str, kind: str) -> bool:
        return _best_effort(
            "read", lambda: super(GuardedJournal, self).was_notified(key, kind), False
        )

    def history(self, user: str | None = None, limit: int = 200) -> list[HistoryEntry]:
        return _best_effort("read", lambda: super(GuardedJournal, self).history(user, limit), [])

    def record_calendar(
        self, name: str, last_success: datetime | None, last_error: str | None, now: datetime
    ) -> None:
        _best_effort(
            "write",
            lambda: super(GuardedJournal, self).record_calendar(
                name, last_success, last_error, now
            ),
            None,
        )

    def calendars(self) -> dict[str, CalendarStatus]:
        return _best_effort("read", lambda: super(GuardedJournal, self).calendars(), {})

    def set_meta(self, name: str, value: str) -> None:
        _best_effort("write", lambda: super(GuardedJournal, self).set_meta(name, value), None)

    def get_meta(self, name: str) -> str | None:
        return _best_effort("read", lambda: super(GuardedJournal, self).get_meta(name), None)

    def meta_with_prefix(self, prefix: str) -> dict[str, str]:
        return _best_effort(
            "read", lambda: super(GuardedJournal, self).meta_with_prefix(prefix), {}
        )

    def delete_meta(self, name: str) -> None:
        _best_effort("write", lambda: super(GuardedJournal, self).delete_meta(name), None)

    def trim(self, now: datetime, retention: timedelta) -> int:
        return _best_effort("trim", lambda: super(GuardedJournal, self).trim(now, retention), 0)


def damaged_name(path: Path, now: datetime) -> Path:
    """Where a damaged journal at `path` is moved: `<name>.damaged-<UTC stamp>`."""
    return path.with_name(f"{path.name}.damaged-{now.astimezone(UTC):%Y%m%dT%H%M%SZ}")


def open_journal(path: Path, *, now: datetime | None = None) -> tuple[GuardedJournal, str | None]:
    """The daemon's journal at `path`, and the problem met opening it (None if none).

    A file that cannot be used (not a database, damaged, a schema that
    contradicts its version) is moved aside with its -wal and -shm to
    `damaged_name(path, now)`, and a fresh journal made; when not even that
    can be written (a full disk, a read-only folder), the journal lives in
    memory until the next start. The problem text says which happened, for
    the admin. Raises `JournalTooNew` (a `UserError`) for a journal written by
    a newer gpuresa, which is left untouched.
    """
    try:
        return GuardedJournal(path), None
    except JournalTooNew:
        raise
    except JournalUnusable as error:
        problem = str(error)
    except UserError as error:
        # cannot be opened (no room, no permission), but may be fine: leave it there
        log.error("%s; keeping the journal in memory until the next start", error)
        return GuardedJournal(Path(":memory:")), (
            f"{error}; the journal is kept in memory until the daemon restarts"
        )
    moved = damaged_name(path, now or datetime.now(UTC))
    for suffix in ("", *COMPANIONS):
        source = Path(f"{path}{suffix}")
        try:
            if source.exists():
                source.rename(Path(f"{moved}{suffix}"))
        except OSError as error:
            log.error("cannot move %s aside: %s", source, error)
            return GuardedJournal(Path(":memory:")), (
                f"{problem}; moving it aside failed ({error}): the journal is kept in memory "
                "until the daemon restarts"
            )
    log.error("%s; moved to %s, starting a fresh journal", problem, moved)
    problem = f"{problem}; moved to {moved} and a fresh journal started"
    try:
        return GuardedJournal(path), problem
    except UserError as error:
        log.error("%s; keeping the journal in memory until the next start", error)
        return GuardedJournal(Path(":memory:")), (
            f"{problem}, which failed too ({error}): the journal is kept in memory until the "
            "daemon restarts"
        )
