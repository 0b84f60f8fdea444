"""GRR's database as a calendar: the booking rows of the mapped rooms, polled cheaply.

GRR (the PHP booking app) keeps its bookings in MySQL/MariaDB: one row of
`<prefix>entry` per occurrence, stamped by the server (`timestamp`, ON
UPDATE CURRENT_TIMESTAMP) whenever GRR writes it; deletions only set
`supprimer = 1`, so they are writes too. A poll reads only the window the
daemon reads from every calendar (`window_past` before now to `window_ahead`
after it), and only the rooms of the calendar's `rooms`:

1. Unchanged: one aggregate query over the window's rows, deleted and
   moderated ones included (how many, the sum of their ids, the latest
   stamp). When it says what the last read said, nothing more is asked.
   Stamps have a resolution of one second, so a read whose latest stamp is
   in the database's current second is not trusted: the next poll reads
   again. Every `FULL_READ_EVERY` the rows are read whatever it says.
2. Changed (or the first poll): in one read-only transaction with a
   consistent snapshot, the rooms and areas, the same aggregate and the live
   rows with their beneficiary's account, each row made a calendar object
   by `gpuresa.reservations.sources.grr_rows`.

A database that cannot be reached, refuses the account, does not answer
within `POLL_DEADLINE` (connection and queries together, see
`grr_connection`) or lacks a configured room raises `SourceError` and leaves
the last good snapshot as it was, like a calendar server's outage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.errors import UserError
from gpuresa.reservations.sources import PollResult, SourceError, grr_connection, one_line
from gpuresa.reservations.sources.grr_connection import Deadline, connect, describe
from gpuresa.reservations.sources.grr_rows import Entry, Room, entry_object
from gpuresa.reservations.sources.snapshot import Snapshot, SnapshotStore, StoredObject

log = logging.getLogger(__name__)

FULL_READ_EVERY = timedelta(minutes=10)
# moderate: 0 none, 1 pending, 2 accepted, 3 refused; only 0 and 2 are bookings
_LIVE = "e.supprimer = 0 AND COALESCE(e.moderate, 0) IN (0, 2)"
# a row ending before it starts is read too, so that it is refused with its reason
_IN_WINDOW = "e.start_time < %s AND (e.end_time > %s OR e.start_time >= %s)"


class GRRSource:
    """The bookings of some rooms of a GRR database; see the module's docstring."""

    def __init__(
        self,
        calendar: CalendarConfig,
        state_dir: Path | None,
        *,
        persist: bool = True,
        window_past: timedelta = timedelta(days=1),
        window_ahead: timedelta = timedelta(days=14),
        window: tuple[datetime, datetime] | None = None,
    ) -> None:
        """Nothing is asked yet; the snapshot under `state_dir` is loaded.

        A poll at `now` reads `now - window_past` to `now + window_ahead`, or
        `window` when it is given (for a command that looks at other dates).
        """
        self.name = calendar.name
        self.calendar = calendar
        self.prefix = calendar.table_prefix
        self.where = describe(calendar)
        self.window_past, self.window_ahead, self.window = window_past, window_ahead, window
        rooms = json.dumps(sorted(calendar.rooms.items())).encode()
        # a snapshot made with another database, prefix or room mapping is not used
        origin = f"{self.where}#{self.prefix}#{hashlib.sha256(rooms).hexdigest()[:16]}"
        directory = state_dir / "calendars" / calendar.name if state_dir is not None else None
        self.store = SnapshotStore(directory, persist=persist)
        self.state: Snapshot = self.store.load(origin)
        self.last_success: datetime | None = (
            self.store.load_success() if self.state.objects else None
        )
        self._connection: Any = None
        self._socket: socket.socket | None = None
        self._room_ids: tuple[int, ...] = ()
        self._last_full = float("-inf")
        self.queries = 0

    def snapshot(self) -> Mapping[str, bytes]:
        """The objects of the last successful read, or of the snapshot loaded from disk."""
        return {name: stored.data for name, stored in self.state.objects.items()}

    def poll(self, now: datetime | None = None) -> PollResult:
        """Read the window's rows if they changed; raises `SourceError` on any failure.

        `now` places the window and is recorded as the time of this success
        (default: the clock). `PollResult.requests` counts the queries sent.
        """
        import pymysql

        now = now or datetime.now(UTC)
        start, end = self.window or (now - self.window_past, now + self.window_ahead)
        bounds = (int(end.timestamp()), int(start.timestamp()), int(start.timestamp()))
        self.queries = 0
        deadline = Deadline(grr_connection.POLL_DEADLINE)
        try:
            with deadline:
                changed, received = self._poll(bounds, deadline)
        except SourceError:
            self._close()
            raise
        except UserError as error:  # the password file or credential
            raise SourceError(f"calendar {self.name}: {error}") from None
        except (pymysql.MySQLError, OSError) as error:
            self._close()
            log.debug("calendar %s: poll failed", self.name, exc_info=True)
            why = (
                f"no answer within {deadline.seconds:g}s (connection and queries together)"
                if deadline.passed()
                else one_line(error)
            )
            raise SourceError(
                f"calendar {self.name}: cannot read the GRR database {self.where}: {why}"
            ) from None
        self.last_success = now
        self.store.save_success(now)
        return PollResult(self.snapshot(), changed, self.queries, received)

    # --- one poll ------------------------------------------------------------------------

    def _poll(self, bounds: tuple[int, int, int], deadline: Deadline) -> tuple[bool, int]:
        """(whether the objects changed, bytes of rows received)."""
        if self._connection is None or self._socket is None:
            self._connection, self._socket = connect(self.calendar, deadline)
        else:
            deadline.watch(self._socket)
        cursor = self._connection.cursor()
        try:
            due = time.monotonic() - self._last_full >= FULL_READ_EVERY.total_seconds()
            if self._room_ids and self.state.etag is not None and not due:
                signature, _ = self._signature(cursor, bounds)
                if signature == self.state.etag:
                    return False, 0
            return self._read(cursor, bounds)
        finally:
            cursor.close()

    def _signature(self, cursor: Any, bounds: tuple[int, int, int]) -> tuple[str, bool]:
        """What the window's rows look like in one line, and whether it can be trusted."""
        marks = ", ".join(["%s"] * len(self._room_ids))
        self._query(
            cursor,
            "SELECT COUNT(*), COALESCE(SUM(e.id), 0), UNIX_TIMESTAMP(MAX(e.`timestamp`)), "
            f"UNIX_TIMESTAMP() FROM `{self.prefix}entry` e "
            f"WHERE e.room_id IN ({marks}) AND {_IN_WINDOW}",
            (*self._room_ids, *bounds),
        )
        count, ids, latest, clock = cursor.fetchone()
        # a write later in the stamp's second would not change it
        settled = latest is None or int(latest) < int(clock) - 1
        return f"{count}:{ids}:{latest}", settled

    def _read(self, cursor: Any, bounds: tuple[int, int, int]) -> tuple[bool, int]:
        self._query(cursor, "START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
        try:
            rooms = self._rooms(cursor)
            signature, settled = self._signature(cursor, bounds)
            marks = ", ".join(["%s"] * len(self._room_ids))
            self._query(
                cursor,
                "SELECT e.id, e.start_time, e.end_time, e.room_id, e.beneficiaire, "
                "e.beneficiaire_ext, e.description, u.login, u.email, u.etat "
                f"FROM `{self.prefix}entry` e LEFT JOIN `{self.prefix}utilisateurs` u "
                f"ON u.login = e.beneficiaire WHERE e.room_id IN ({marks}) AND {_IN_WINDOW} "
                f"AND {_LIVE}",
                (*self._room_ids, *bounds),
            )
            rows = cursor.fetchall()
        finally:
            self._query(cursor, "COMMIT")
        objects: dict[str, StoredObject] = {}
        received = 0
        for row in rows:
            entry = Entry(
                int(row[0]), int(row[1]), int(row[2]), int(row[3]), *map(_string, row[4:7]),
                *map(_optional, row[7:10]),
            )  # fmt: skip
            room, host = rooms[entry.room_id]
            name, data = entry_object(entry, room, host, self.prefix)
            objects[name] = StoredObject(data)
            received += len(data)
        changed = {name: item.data for name, item in objects.items()} != self.snapshot()
        self.state.objects = objects
        self.state.etag = signature if settled else None
        self._last_full = time.monotonic()
        if changed or not self.state.objects:
            self.store.save(self.state)
        log.debug(
            "calendar %s: %d row(s) read in %d queries", self.name, len(objects), self.queries
        )
        return changed, received

    def _rooms(self, cursor: Any) -> dict[int, tuple[Room, str]]:
        """The mapped rooms by id, with their hosts; `SourceError` for a room not found."""
        self._query(
            cursor,
            "SELECT r.id, r.room_name, COALESCE(a.area_name, ''), COALESCE(a.enable_periods, '') "
            f"FROM `{self.prefix}room` r LEFT JOIN `{self.prefix}area` a ON a.id = r.area_id",
        )
        every = [
            Room(int(row[0]), _string(row[1]), _string(row[2]), _string(row[3]) == "y")
            for row in cursor.fetchall()
        ]
        mapped: dict[int, tuple[Room, str]] = {}
        for wanted, host in self.calendar.rooms.items():
            if wanted.startswith("#"):
                found = [room for room in every if str(room.id) == wanted[1:]]
            else:
                found = [room for room in every if room.name.strip() == wanted.strip()]
            if len(found) != 1:
                # a room renamed in GRR must not read as every booking of it cancelled
                what = "no GRR room" if not found else f"{len(found)} GRR rooms (use '#id')"
                raise SourceError(
                    f"calendar {self.name}: {what} named {wanted!r} in {self.where} "
                    f"(its rooms: {', '.join(sorted(room.name for room in every)[:20])})"
                )
            mapped[found[0].id] = (found[0], host)
        self._room_ids = tuple(sorted(mapped))
        return mapped

    def _query(self, cursor: Any, sql: str, arguments: tuple[object, ...] = ()) -> None:
        self.queries += 1
        cursor.execute(sql, arguments or None)

    def _close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:  # already broken: nothing to say
                log.debug("calendar %s: closing the connection failed", self.name)
            self._connection = None
            self._socket = None


def _string(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def _optional(value: object) -> str | None:
    return None if value is None else _string(value)
