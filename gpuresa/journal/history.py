"""The journal's history: each reservation's state, every change and action, and the notices sent.

A part of `gpuresa.journal.store.Journal` (mixed in, like the outbox), kept
apart for size; the tables are made by the journal's migrations
(`gpuresa.journal.schema`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from gpuresa.journal.schema import RESULTS, STATES
from gpuresa.journal.times import from_text, to_text


@dataclass(frozen=True)
class HistoryEntry:
    """One line of a reservation's history: a change of state or an action.

    `kind` is "state" (`what` is "previous → new", `detail` why) or "action"
    (`what` is "action: ok|failed", `detail` the error). `user` is the
    reservation's (or rejected booking's) login, None when the journal never
    saw the booking.
    """

    at: datetime
    key: str
    user: str | None
    kind: Literal["state", "action"]
    what: str
    detail: str


class HistoryTable:
    """The state, history and notice methods of the journal; needs `_transaction` and `_query`
    (see `Journal`)."""

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _query(self, sql: str, parameters: Sequence[Any] = ()) -> list[sqlite3.Row]:
        raise NotImplementedError

    def state(self, key: str) -> str | None:
        """The lifecycle state of `key`, or None when it never had one."""
        rows = self._query("SELECT state FROM states WHERE key = ?", (key,))
        return str(rows[0]["state"]) if rows else None

    def states(self) -> dict[str, str]:
        """Every key's lifecycle state."""
        return {row["key"]: row["state"] for row in self._query("SELECT key, state FROM states")}

    def state_since(self, key: str) -> datetime | None:
        """When `key` entered its current state, or None when it has none."""
        rows = self._query("SELECT since FROM states WHERE key = ?", (key,))
        return from_text(rows[0]["since"]) if rows else None

    def state_detail(self, key: str) -> str:
        """Why `key` is in its current state (a failure's error, say); "" when not recorded."""
        rows = self._query("SELECT detail FROM states WHERE key = ?", (key,))
        return str(rows[0]["detail"]) if rows else ""

    def set_state(self, key: str, state: str, now: datetime, detail: str = "") -> bool:
        """Move `key` to `state`; record the transition only if the state changes.

        Returns True when it changed (and a history row was written), False
        when `key` already was in `state`. Raises ValueError for a state that is
        not one of `STATES`.
        """
        if state not in STATES:
            raise ValueError(f"unknown lifecycle state {state!r} (known: {', '.join(STATES)})")
        at = to_text(now)
        with self._transaction() as connection:
            row = connection.execute("SELECT state FROM states WHERE key = ?", (key,)).fetchone()
            previous = None if row is None else str(row[0])
            if previous == state:
                return False
            connection.execute(
                """
                INSERT INTO states (key, state, since, detail) VALUES (?, ?, ?, ?)
                ON CONFLICT (key) DO UPDATE SET
                    state = excluded.state, since = excluded.since, detail = excluded.detail
                """,
                (key, state, at, detail),
            )
            connection.execute(
                "INSERT INTO events (key, at, kind, name, previous, detail) "
                "VALUES (?, ?, 'state', ?, ?, ?)",
                (key, at, state, previous, detail),
            )
        return True

    def record_action(
        self, key: str, action: str, now: datetime, result: str, error: str | None = None
    ) -> None:
        """Record that `action` ran for `key`, with `result` "ok" or "failed" and the error.

        Raises ValueError for another result.
        """
        if result not in RESULTS:
            raise ValueError(f"an action's result is 'ok' or 'failed', not {result!r}")
        with self._transaction() as connection:
            connection.execute(
                "INSERT INTO events (key, at, kind, name, result, detail) "
                "VALUES (?, ?, 'action', ?, ?, ?)",
                (key, to_text(now), action, result, error or ""),
            )

    def mark_notified(self, key: str, kind: str, now: datetime) -> bool:
        """Claim the notice `kind` for `key`: True the first time, False ever after.

        Kinds such as "start", "warning-900", "end", or `rejection_notice_kind(reason)`.
        The claim is committed before this returns, so it survives a restart.
        """
        with self._transaction() as connection:
            cursor = connection.execute(
                "INSERT OR IGNORE INTO notifications (key, kind, at) VALUES (?, ?, ?)",
                (key, kind, to_text(now)),
            )
            return cursor.rowcount == 1

    def unmark_notified(self, key: str, kind: str) -> None:
        """Forget the claim on the notice `kind` for `key`, so it can be sent again.

        For a notice whose sending failed after `mark_notified` claimed it; the
        next `mark_notified` returns True again. Nothing happens if there is no
        claim. The outbox forgets that notice too (sent or not: an unsent one
        is outdated, and the caller enqueues its successor). Committed before
        this returns.
        """
        with self._transaction() as connection:
            connection.execute(
                "DELETE FROM notifications WHERE key = ? AND kind = ?",
                (key, kind),
            )
            connection.execute("DELETE FROM outbox WHERE key = ? AND kind = ?", (key, kind))

    def notified(self, key: str) -> dict[str, datetime]:
        """The notices sent for `key`: kind → when."""
        rows = self._query("SELECT kind, at FROM notifications WHERE key = ?", (key,))
        return {row["kind"]: from_text(row["at"]) for row in rows}

    def history(self, user: str | None = None, limit: int = 200) -> list[HistoryEntry]:
        """The last `limit` transitions and actions (of `user`'s bookings if given), newest last."""
        sql = """
            SELECT events.*, COALESCE(reservations.user, rejections.user) AS user
            FROM events
            LEFT JOIN reservations ON reservations.key = events.key
            LEFT JOIN rejections ON rejections.key = events.key
        """
        parameters: list[Any] = []
        if user is not None:
            sql += " WHERE COALESCE(reservations.user, rejections.user) = ?"
            parameters.append(user)
        sql += " ORDER BY events.at DESC, events.id DESC LIMIT ?"
        parameters.append(max(0, limit))
        entries = []
        for row in reversed(self._query(sql, parameters)):
            if row["kind"] == "state":
                what = f"{row['previous'] or '(new)'} → {row['name']}"
                kind: Literal["state", "action"] = "state"
            else:
                what = f"{row['name']}: {row['result']}"
                kind = "action"
            entries.append(
                HistoryEntry(
                    at=from_text(row["at"]),
                    key=row["key"],
                    user=row["user"],
                    kind=kind,
                    what=what,
                    detail=row["detail"],
                )
            )
        return entries
