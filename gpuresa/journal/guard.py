"""The journal as the daemon uses it: it never keeps a session from ending.

A full disk, a damaged file or a database that vanished must not stop the
daemon from stopping sessions at their end: it acts on Docker first and
records what it can. So:

- `GuardedJournal` logs a failed read or write and returns a fallback (an
  empty result, None, False) instead of raising. Every public method of every
  table is guarded by construction (see `gpuresa.journal.database`), the
  outbox's too: its `add` falls back to None, "not stored", so the outbox
  keeps that message in memory.
- `open_journal` moves a journal that cannot be used aside
  (`journal.sqlite.damaged-<UTC stamp>`, with its -wal and -shm) and starts a
  fresh one, and says so, so the daemon can tell the admin. A journal
  written by a newer gpuresa is refused, never moved: its data is not ours
  to throw away. When no file can be written at all, the daemon still runs,
  on a journal in memory.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from gpuresa.errors import UserError
from gpuresa.journal.store import COMPANIONS, Journal, JournalTooNew, JournalUnusable

log = logging.getLogger(__name__)


class GuardedJournal(Journal):
    """The journal, with reads and writes that log their failure instead of raising.

    Each method falls back to what lets the daemon go on: reads to an empty
    result or None, writes to nothing. `notices.claim` falls back to True: a
    notice whose claim cannot be recorded is sent (twice is better than never).
    """

    def __init__(self, path: Path, *, timeout: float = 10.0) -> None:
        super().__init__(path, timeout=timeout, guarded=True)


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
