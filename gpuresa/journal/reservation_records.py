"""The journal's reservations and rejections: what each look at the calendars found, and since when.

A table of `gpuresa.journal.store.Journal` (`journal.reservations`); the SQL
tables are made by the journal's migrations (`gpuresa.journal.schema`).
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from gpuresa.journal.database import Table, reads, writes
from gpuresa.journal.times import from_text, optional_text, optional_time, to_text
from gpuresa.model import Rejection, Reservation


@dataclass(frozen=True)
class RejectionRecord:
    """A rejected booking as the journal keeps it: the rejection and since when."""

    rejection: Rejection
    first_seen: datetime
    last_seen: datetime
    reason_since: datetime


def rejection_notice_kind(reason: str) -> str:
    """The notice kind for a rejection notice: "rejected:" and a hash of the reason.

    A booking rejected again for another reason gets a new notice; the same
    reason never twice.
    """
    return "rejected:" + hashlib.sha256(reason.encode("utf-8")).hexdigest()[:16]


class ReservationTable(Table):
    """The reservations and rejections seen in the calendars (`journal.reservations`).

    Guarded, `record` falls back to [] (no rejection to announce) and reads
    to None or an empty result.
    """

    _label = "reservations."

    @writes(fallback=[])
    def record(
        self,
        reservations: Iterable[Reservation],
        rejected: Iterable[Rejection],
        now: datetime,
    ) -> list[Rejection]:
        """Record what one look at the calendars found; return the rejections to announce.

        Every reservation and rejection is inserted or updated (first seen is
        kept, last seen becomes `now`). A key seen as a reservation is no
        longer rejected. Returns the rejections that are new, or whose reason
        changed since the last time, in the order given.
        """
        seen = to_text(now)
        announce: list[Rejection] = []
        with self._database.transaction() as connection:
            for reservation in reservations:
                connection.execute(
                    """
                    INSERT INTO reservations (key, uid, recurrence_id, calendar, host, user,
                        template, cuda, gpus, start_at, end_at, email, summary, created, stamp,
                        tentative, first_seen, last_seen, href)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (key) DO UPDATE SET
                        uid = excluded.uid, recurrence_id = excluded.recurrence_id,
                        calendar = excluded.calendar, host = excluded.host,
                        user = excluded.user, template = excluded.template,
                        cuda = excluded.cuda, gpus = excluded.gpus,
                        start_at = excluded.start_at, end_at = excluded.end_at,
                        email = excluded.email, summary = excluded.summary,
                        created = excluded.created, stamp = excluded.stamp,
                        tentative = excluded.tentative, last_seen = excluded.last_seen,
                        href = CASE WHEN reservations.href = '' THEN excluded.href
                            ELSE reservations.href END
                    """,
                    (
                        reservation.key,
                        reservation.uid,
                        reservation.recurrence_id,
                        reservation.calendar,
                        reservation.host,
                        reservation.user,
                        reservation.template,
                        reservation.cuda,
                        reservation.gpus,
                        to_text(reservation.start),
                        to_text(reservation.end),
                        reservation.email,
                        reservation.summary,
                        optional_text(reservation.created),
                        optional_text(reservation.stamp),
                        int(reservation.tentative),
                        # a booking rejected before keeps the time gpuresa first saw it
                        _first_seen(connection, reservation.key, seen),
                        seen,
                        reservation.href,
                    ),
                )
                # the booking was fixed: it is no longer rejected
                connection.execute("DELETE FROM rejections WHERE key = ?", (reservation.key,))
            for rejection in rejected:
                row = connection.execute(
                    "SELECT reason FROM rejections WHERE key = ?", (rejection.key,)
                ).fetchone()
                changed = row is None or row[0] != rejection.reason
                if changed:
                    announce.append(rejection)
                connection.execute(
                    """
                    INSERT INTO rejections (key, uid, calendar, reason, user, email, start_at,
                        end_at, first_seen, last_seen, reason_since)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (key) DO UPDATE SET
                        uid = excluded.uid, calendar = excluded.calendar,
                        reason = excluded.reason, user = excluded.user, email = excluded.email,
                        start_at = excluded.start_at, end_at = excluded.end_at,
                        last_seen = excluded.last_seen,
                        reason_since = CASE WHEN rejections.reason = excluded.reason
                            THEN rejections.reason_since ELSE excluded.reason_since END
                    """,
                    (
                        rejection.key,
                        rejection.uid,
                        rejection.calendar,
                        rejection.reason,
                        rejection.user,
                        rejection.email,
                        optional_text(rejection.start),
                        optional_text(rejection.end),
                        _first_seen(connection, rejection.key, seen),
                        seen,
                        seen,
                    ),
                )
        return announce

    @reads(fallback=None)
    def get(self, key: str) -> Reservation | None:
        """The reservation `key` as last seen in a calendar, or None if never seen."""
        rows = self._database.query("SELECT * FROM reservations WHERE key = ?", (key,))
        return _reservation(rows[0]) if rows else None

    @reads(fallback=[])
    def all(self, ending_after: datetime | None = None) -> list[Reservation]:
        """Every reservation seen (those ending after `ending_after` if given), by start."""
        if ending_after is None:
            rows = self._database.query("SELECT * FROM reservations ORDER BY start_at, key")
        else:
            rows = self._database.query(
                "SELECT * FROM reservations WHERE end_at > ? ORDER BY start_at, key",
                (to_text(ending_after),),
            )
        return [_reservation(row) for row in rows]

    @reads(fallback=[])
    def rejections(self, ending_after: datetime | None = None) -> list[RejectionRecord]:
        """The bookings rejected now (not fixed since), by start; those ending after
        `ending_after` (or with no known end) if given.
        """
        sql = "SELECT * FROM rejections"
        parameters: tuple[str, ...] = ()
        if ending_after is not None:
            sql += " WHERE end_at IS NULL OR end_at > ?"
            parameters = (to_text(ending_after),)
        rows = self._database.query(sql + " ORDER BY start_at, key", parameters)
        return [
            RejectionRecord(
                rejection=Rejection(
                    key=row["key"],
                    uid=row["uid"],
                    calendar=row["calendar"],
                    reason=row["reason"],
                    user=row["user"],
                    email=row["email"],
                    start=optional_time(row["start_at"]),
                    end=optional_time(row["end_at"]),
                ),
                first_seen=from_text(row["first_seen"]),
                last_seen=from_text(row["last_seen"]),
                reason_since=from_text(row["reason_since"]),
            )
            for row in rows
        ]

    @reads(fallback={})
    def first_seen_times(self) -> dict[str, datetime]:
        """When gpuresa first saw each booking, as a reservation or a rejection, by key.

        What decides between over-booked reservations (the one seen first
        wins): unlike CREATED, nobody can write it into an event.
        """
        rows = self._database.query(
            """
            SELECT key, MIN(first_seen) AS first_seen FROM (
                SELECT key, first_seen FROM reservations
                UNION ALL SELECT key, first_seen FROM rejections
            ) GROUP BY key
            """
        )
        return {str(row["key"]): from_text(row["first_seen"]) for row in rows}

    @reads(fallback={})
    def origins(self) -> dict[str, tuple[str, str]]:
        """Where gpuresa first saw each UID as a reservation: (calendar, object href).

        What decides between copies of one UID (see `gpuresa.reservations.claims`): the
        copy in that calendar and object keeps the booking.
        """
        rows = self._database.query(
            "SELECT uid, calendar, href, first_seen FROM reservations ORDER BY first_seen DESC"
        )
        # the earliest row of each UID comes last, so it is the one kept
        return {str(row["uid"]): (str(row["calendar"]), str(row["href"])) for row in rows}

    @reads(fallback={})
    def ended_times(self) -> dict[str, tuple[datetime, datetime]]:
        """The times each booking whose session ended had when it ended, by key."""
        rows = self._database.query(
            """
            SELECT reservations.key, start_at, end_at FROM reservations
            JOIN states ON states.key = reservations.key WHERE states.state = 'ended'
            """
        )
        return {
            str(row["key"]): (from_text(row["start_at"]), from_text(row["end_at"])) for row in rows
        }


def _first_seen(connection: sqlite3.Connection, key: str, now: str) -> str:
    """The earliest first sight of `key` in either table, or `now` when it is new."""
    row = connection.execute(
        """
        SELECT MIN(first_seen) FROM (
            SELECT first_seen FROM reservations WHERE key = ?
            UNION ALL SELECT first_seen FROM rejections WHERE key = ?
        )
        """,
        (key, key),
    ).fetchone()
    return str(row[0]) if row is not None and row[0] is not None else now


def _reservation(row: sqlite3.Row) -> Reservation:
    return Reservation(
        key=row["key"],
        uid=row["uid"],
        recurrence_id=row["recurrence_id"],
        calendar=row["calendar"],
        host=row["host"],
        user=row["user"],
        template=row["template"],
        cuda=row["cuda"],
        gpus=int(row["gpus"]),
        start=from_text(row["start_at"]),
        end=from_text(row["end_at"]),
        email=row["email"],
        summary=row["summary"],
        created=optional_time(row["created"]),
        stamp=optional_time(row["stamp"]),
        tentative=bool(row["tentative"]),
        href=row["href"],
    )
