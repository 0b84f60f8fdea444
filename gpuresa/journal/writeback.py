"""The journal's write-back table: the state each booking's calendar should show.

A table of `gpuresa.journal.store.Journal` (`journal.writeback`);
`gpuresa.writeback.worker` writes what is queued here into the calendars. One
row per booking key holds the latest state to write: a newer state replaces
an older one not yet written (only the latest matters to a reader), and the
same state queued again is no new write (deduplicated per key and state).
The SQL table is made by the journal's migrations.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime

from gpuresa.journal.database import Table, reads, writes
from gpuresa.journal.times import from_text, optional_text, optional_time, to_text


@dataclass(frozen=True)
class WriteBackRow:
    """One booking's state to write back, and how writing it went so far.

    `href` is the calendar object the booking was read from ("" when not
    known: a rejection); `start` and `end` are None for a booking whose
    times could not be read. `written_at` is None until the write succeeded
    (or was given up, with `last_error` saying why).
    """

    key: str
    calendar: str
    uid: str
    href: str
    state: str
    detail: str
    text: str
    summary: str
    start: datetime | None
    end: datetime | None
    queued_at: datetime
    attempts: int
    last_error: str | None
    next_try: datetime
    written_at: datetime | None


class WriteBackTable(Table):
    """Each booking's state to write back (`journal.writeback`).

    Guarded, `put` falls back to None ("not stored"), the other writes to
    nothing, `due` and `unwritten` to [], `soonest` and `get` to None.
    """

    _label = "writeback."

    @writes(fallback=None)
    def put(self, row: WriteBackRow) -> bool | None:
        """Queue `row` (its `queued_at` and `next_try` as given, attempts 0); False, changing
        nothing, when the booking's row already holds this state, detail and text."""
        with self._database.transaction() as connection:
            found = connection.execute(
                "SELECT state, detail, text, summary FROM writeback WHERE key = ?", (row.key,)
            ).fetchone()
            if found is not None and tuple(found) == (row.state, row.detail, row.text, row.summary):
                return False
            connection.execute(
                """
                INSERT OR REPLACE INTO writeback (key, calendar, uid, href, state, detail, text,
                    summary, start_at, end_at, queued_at, attempts, last_error, next_try,
                    written_at)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, NULL, ?, NULL)
                """,
                (
                    row.key,
                    row.calendar,
                    row.uid,
                    row.href,
                    row.state,
                    row.detail,
                    row.text,
                    row.summary,
                    optional_text(row.start),
                    optional_text(row.end),
                    to_text(row.queued_at),
                    to_text(row.next_try),
                ),
            )
            return True

    @reads(fallback=[])
    def due(self, now: datetime) -> list[WriteBackRow]:
        """The rows not written yet whose next try is at or before `now`, oldest first."""
        rows = self._database.query(
            "SELECT * FROM writeback WHERE written_at IS NULL AND next_try <= ? "
            "ORDER BY queued_at, key",
            (to_text(now),),
        )
        return [_row(row) for row in rows]

    @reads(fallback=[])
    def unwritten(self) -> list[WriteBackRow]:
        """Every row not written yet, oldest first (for `gpuresa status`)."""
        rows = self._database.query(
            "SELECT * FROM writeback WHERE written_at IS NULL ORDER BY queued_at, key"
        )
        return [_row(row) for row in rows]

    @reads(fallback=None)
    def soonest(self) -> datetime | None:
        """The soonest next try among the rows not written yet."""
        rows = self._database.query(
            "SELECT MIN(next_try) AS soonest FROM writeback WHERE written_at IS NULL"
        )
        return optional_time(rows[0]["soonest"])

    @reads(fallback=None)
    def get(self, key: str) -> WriteBackRow | None:
        """The row of booking `key`, if any."""
        rows = self._database.query("SELECT * FROM writeback WHERE key = ?", (key,))
        return _row(rows[0]) if rows else None

    @reads(fallback=[])
    def of_calendars(self, calendars: list[str]) -> list[WriteBackRow]:
        """The rows of bookings of `calendars`."""
        marks = ",".join("?" * len(calendars))
        rows = self._database.query(
            f"SELECT * FROM writeback WHERE calendar IN ({marks}) ORDER BY key", tuple(calendars)
        )
        return [_row(row) for row in rows]

    @writes(fallback=None)
    def mark_written(self, key: str, queued_at: datetime, now: datetime) -> None:
        """Record that the row of `key` queued at `queued_at` is written (a newer row queued
        meanwhile stays to be written)."""
        with self._database.transaction() as connection:
            connection.execute(
                "UPDATE writeback SET written_at = ?, attempts = attempts + 1, "
                "last_error = NULL WHERE key = ? AND queued_at = ?",
                (to_text(now), key, to_text(queued_at)),
            )

    @writes(fallback=None)
    def mark_failed(self, key: str, queued_at: datetime, error: str, next_try: datetime) -> None:
        """Record a failed attempt at the row of `key`, tried again at `next_try`."""
        with self._database.transaction() as connection:
            connection.execute(
                "UPDATE writeback SET attempts = attempts + 1, last_error = ?, next_try = ? "
                "WHERE key = ? AND queued_at = ? AND written_at IS NULL",
                (error, to_text(next_try), key, to_text(queued_at)),
            )

    @writes(fallback=None)
    def give_up(self, key: str, queued_at: datetime, now: datetime, reason: str) -> None:
        """Give up writing the row of `key`; its history says why."""
        with self._database.transaction() as connection:
            cursor = connection.execute(
                "UPDATE writeback SET written_at = ?, last_error = ? "
                "WHERE key = ? AND queued_at = ? AND written_at IS NULL",
                (to_text(now), reason, key, to_text(queued_at)),
            )
            if cursor.rowcount == 1:
                connection.execute(
                    "INSERT INTO events (key, at, kind, name, result, detail) "
                    "VALUES (?, ?, 'action', 'calendar write-back', 'failed', ?)",
                    (key, to_text(now), reason),
                )

    @writes(fallback=None)
    def forget_before(self, before: datetime) -> None:
        """Forget the written rows of bookings that ended before `before`."""
        with self._database.transaction() as connection:
            connection.execute(
                "DELETE FROM writeback WHERE written_at IS NOT NULL AND end_at IS NOT NULL "
                "AND end_at < ?",
                (to_text(before),),
            )


def _row(row: sqlite3.Row) -> WriteBackRow:
    return WriteBackRow(
        key=row["key"],
        calendar=row["calendar"],
        uid=row["uid"],
        href=row["href"],
        state=row["state"],
        detail=row["detail"],
        text=row["text"],
        summary=row["summary"],
        start=optional_time(row["start_at"]),
        end=optional_time(row["end_at"]),
        queued_at=from_text(row["queued_at"]),
        attempts=int(row["attempts"]),
        last_error=row["last_error"],
        next_try=from_text(row["next_try"]),
        written_at=optional_time(row["written_at"]),
    )
