"""The journal's history: each reservation's state, every change and action, and the notices sent.

Three tables of `gpuresa.journal.store.Journal`: `journal.states`,
`journal.history` and `journal.notices`. Their SQL tables are made by the
journal's migrations (`gpuresa.journal.schema`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from gpuresa.journal.database import Table, reads, writes
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


class StateTable(Table):
    """Each reservation's lifecycle state, and since when (`journal.states`).

    Guarded, `set` falls back to False (nothing changed) and reads to None,
    "" or an empty result.
    """

    _label = "states."

    @reads(fallback=None)
    def get(self, key: str) -> str | None:
        """The lifecycle state of `key`, or None when it never had one."""
        rows = self._database.query("SELECT state FROM states WHERE key = ?", (key,))
        return str(rows[0]["state"]) if rows else None

    @reads(fallback={})
    def all(self) -> dict[str, str]:
        """Every key's lifecycle state."""
        rows = self._database.query("SELECT key, state FROM states")
        return {row["key"]: row["state"] for row in rows}

    @reads(fallback=None)
    def since(self, key: str) -> datetime | None:
        """When `key` entered its current state, or None when it has none."""
        rows = self._database.query("SELECT since FROM states WHERE key = ?", (key,))
        return from_text(rows[0]["since"]) if rows else None

    @reads(fallback="")
    def detail(self, key: str) -> str:
        """Why `key` is in its current state (a failure's error, say); "" when not recorded."""
        rows = self._database.query("SELECT detail FROM states WHERE key = ?", (key,))
        return str(rows[0]["detail"]) if rows else ""

    @writes(fallback=False)
    def set(self, key: str, state: str, now: datetime, detail: str = "") -> bool:
        """Move `key` to `state`; record the transition only if the state changes.

        Returns True when it changed (and a history row was written), False
        when `key` already was in `state`. Raises ValueError for a state that is
        not one of `STATES`.
        """
        if state not in STATES:
            raise ValueError(f"unknown lifecycle state {state!r} (known: {', '.join(STATES)})")
        at = to_text(now)
        with self._database.transaction() as connection:
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


class HistoryTable(Table):
    """Every change of state and every action, in order (`journal.history`).

    Guarded, `record_action` falls back to nothing and `entries` to [].
    """

    _label = "history."

    @writes(fallback=None)
    def record_action(
        self, key: str, action: str, now: datetime, result: str, error: str | None = None
    ) -> None:
        """Record that `action` ran for `key`, with `result` "ok" or "failed" and the error.

        Raises ValueError for another result.
        """
        if result not in RESULTS:
            raise ValueError(f"an action's result is 'ok' or 'failed', not {result!r}")
        with self._database.transaction() as connection:
            connection.execute(
                "INSERT INTO events (key, at, kind, name, result, detail) "
                "VALUES (?, ?, 'action', ?, ?, ?)",
                (key, to_text(now), action, result, error or ""),
            )

    @reads(fallback=[])
    def entries(self, user: str | None = None, limit: int = 200) -> list[HistoryEntry]:
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
        for row in reversed(self._database.query(sql, parameters)):
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


class NoticeTable(Table):
    """Which notices went out for each reservation, so none is sent twice (`journal.notices`).

    Guarded, `claim` falls back to True: a notice whose claim cannot be
    recorded is sent (twice is better than never); `was_sent` to False.
    """

    _label = "notices."

    @writes(fallback=True)
    def claim(self, key: str, kind: str, now: datetime) -> bool:
        """Claim the notice `kind` for `key`: True the first time, False ever after.

        Kinds such as "start", "warning-900", "end", or `rejection_notice_kind(reason)`.
        The claim is committed before this returns, so it survives a restart.
        """
        with self._database.transaction() as connection:
            cursor = connection.execute(
                "INSERT OR IGNORE INTO notifications (key, kind, at) VALUES (?, ?, ?)",
                (key, kind, to_text(now)),
            )
            return cursor.rowcount == 1

    @writes(fallback=None)
    def release(self, key: str, kind: str) -> None:
        """Forget the claim on the notice `kind` for `key`, so it can be sent again.

        For a notice whose sending failed after `claim`; the next `claim`
        returns True again. Nothing happens if there is no
        claim. The outbox forgets that notice too (sent or not: an unsent one
        is outdated, and the caller enqueues its successor). Committed before
        this returns.
        """
        with self._database.transaction() as connection:
            connection.execute(
                "DELETE FROM notifications WHERE key = ? AND kind = ?",
                (key, kind),
            )
            connection.execute("DELETE FROM outbox WHERE key = ? AND kind = ?", (key, kind))

    @reads(fallback={})
    def claimed(self, key: str) -> dict[str, datetime]:
        """The notices sent (or claimed) for `key`: kind → when."""
        rows = self._database.query("SELECT kind, at FROM notifications WHERE key = ?", (key,))
        return {row["kind"]: from_text(row["at"]) for row in rows}

    @reads(fallback=False)
    def was_sent(self, key: str, kind: str) -> bool:
        """Whether the notice (`key`, `kind`) was sent by the outbox (or claimed with `claim`)."""
        rows = self._database.query(
            "SELECT 1 FROM notifications WHERE key = ? AND kind = ? "
            "UNION ALL SELECT 1 FROM outbox WHERE key = ? AND kind = ? AND sent_at IS NOT NULL",
            (key, kind, key, kind),
        )
        return bool(rows)
