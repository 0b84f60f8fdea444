"""The journal's outbox table: e-mails waiting for the relay, and which notices went out.

A table of `gpuresa.journal.store.Journal` (`journal.outbox`); `gpuresa.mail.outbox`
sends what is queued here. The SQL table is made by the journal's migrations.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime

from gpuresa.journal.database import Table, reads, writes
from gpuresa.journal.times import from_text, optional_time, to_text


@dataclass(frozen=True)
class OutboxMessage:
    """One e-mail of the outbox, as stored: what to send and how sending went so far.

    `kind` is the deduplication key per reservation key (None: never
    deduplicated). `sent_at` is None until the relay accepted it.
    """

    id: int
    key: str
    kind: str | None
    address: str
    subject: str
    body: str
    copy_admin: bool
    queued_at: datetime
    attempts: int
    last_error: str | None
    next_try: datetime
    sent_at: datetime | None


class OutboxTable(Table):
    """The e-mails to send and how sending them went (`journal.outbox`).

    Guarded, `add` falls back to None ("not stored": the caller keeps the
    message in memory), the other writes to nothing, `unsent` to [] and
    `backlog` to (0, None).
    """

    _label = "outbox."

    @writes(fallback=None)
    def add(
        self,
        key: str,
        kind: str | None,
        address: str,
        subject: str,
        body: str,
        copy_admin: bool,
        now: datetime,
    ) -> bool | None:
        """Queue one e-mail, to be tried at once; False (nothing queued) when the notice
        (`key`, `kind`) was queued or sent before. A None `kind` is always queued.

        Guarded, None when the journal could not store it.
        """
        with self._database.transaction() as connection:
            if kind is not None:
                # sent before the outbox existed, or claimed through `journal.notices.claim`
                claimed = connection.execute(
                    "SELECT 1 FROM notifications WHERE key = ? AND kind = ?", (key, kind)
                ).fetchone()
                if claimed is not None:
                    return False
            at = to_text(now)
            cursor = connection.execute(
                """
                INSERT OR IGNORE INTO outbox (key, kind, address, subject, body, copy_admin,
                    queued_at, next_try)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (key, kind, address, subject, body, int(copy_admin), at, at),
            )
            return cursor.rowcount == 1

    @reads(fallback=[])
    def unsent(self, due_by: datetime | None = None) -> list[OutboxMessage]:
        """The e-mails not sent (nor dropped) yet, oldest first; with `due_by`, only
        those whose next try is at or before it, soonest first."""
        sql = "SELECT * FROM outbox WHERE sent_at IS NULL AND dropped_at IS NULL"
        if due_by is None:
            rows = self._database.query(sql + " ORDER BY queued_at, id")
        else:
            rows = self._database.query(
                sql + " AND next_try <= ? ORDER BY next_try, id", (to_text(due_by),)
            )
        return [_outbox_message(row) for row in rows]

    @reads(fallback=(0, None))
    def backlog(self) -> tuple[int, datetime | None]:
        """How many e-mails wait to be sent, and the soonest next try among them."""
        rows = self._database.query(
            "SELECT count(*) AS waiting, MIN(next_try) AS soonest FROM outbox "
            "WHERE sent_at IS NULL AND dropped_at IS NULL"
        )
        return int(rows[0]["waiting"]), optional_time(rows[0]["soonest"])

    @writes(fallback=None)
    def mark_sent(self, message_id: int, now: datetime) -> None:
        """Record that the relay accepted message `message_id` (and claim its notice)."""
        with self._database.transaction() as connection:
            cursor = connection.execute(
                "UPDATE outbox SET sent_at = ?, attempts = attempts + 1, last_error = NULL "
                "WHERE id = ? AND sent_at IS NULL",
                (to_text(now), message_id),
            )
            if cursor.rowcount == 1:
                # only while the row exists: `notices.release` may have withdrawn it meanwhile
                connection.execute(
                    "INSERT OR IGNORE INTO notifications (key, kind, at) "
                    "SELECT key, kind, ? FROM outbox WHERE id = ? AND kind IS NOT NULL",
                    (to_text(now), message_id),
                )

    @writes(fallback=None)
    def mark_failed(self, message_id: int, error: str, next_try: datetime) -> None:
        """Record a failed attempt at message `message_id`, tried again at `next_try`."""
        with self._database.transaction() as connection:
            connection.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_error = ?, next_try = ? "
                "WHERE id = ? AND sent_at IS NULL",
                (error, to_text(next_try), message_id),
            )

    @writes(fallback=None)
    def drop(self, message_id: int, now: datetime, reason: str) -> None:
        """Give up on message `message_id`; the history of its key shows why."""
        with self._database.transaction() as connection:
            row = connection.execute(
                "SELECT key, subject FROM outbox WHERE id = ? AND sent_at IS NULL", (message_id,)
            ).fetchone()
            if row is None:
                return
            connection.execute(
                "UPDATE outbox SET dropped_at = ?, last_error = ? WHERE id = ?",
                (to_text(now), reason, message_id),
            )
            connection.execute(
                "INSERT INTO events (key, at, kind, name, result, detail) "
                "VALUES (?, ?, 'action', ?, 'failed', ?)",
                (row[0], to_text(now), f"mail {row[1]!r} dropped", reason),
            )


def _outbox_message(row: sqlite3.Row) -> OutboxMessage:
    return OutboxMessage(
        id=int(row["id"]),
        key=row["key"],
        kind=row["kind"],
        address=row["address"],
        subject=row["subject"],
        body=row["body"],
        copy_admin=bool(row["copy_admin"]),
        queued_at=from_text(row["queued_at"]),
        attempts=int(row["attempts"]),
        last_error=row["last_error"],
        next_try=from_text(row["next_try"]),
        sent_at=optional_time(row["sent_at"]),
    )
