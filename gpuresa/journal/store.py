"""The journal: an SQLite record of every reservation's lifecycle and every action taken.

One file in the state directory, in WAL mode, so `gpuresa status` and
`gpuresa history` (other processes) read it while the daemon writes it. It
holds:

- every reservation and rejection seen in the calendars (first and last seen);
- each reservation's lifecycle state, and a row for every change of state;
- every action with its result or error;
- which notices were sent, so a restarted daemon never sends one twice;
- the outbox: e-mails waiting to be sent (or sent), see `gpuresa.mail.outbox`;
- each calendar's freshness and a few daemon facts (`meta`).

The file, its -wal and -shm companions and its folder are readable by root
only (they hold users' addresses and bookings). `trim` forgets what is older
than the retention. `gpuresa.journal.guard` opens the journal for the daemon:
a damaged file is moved aside, and no failure of the journal ever raises.

All instants are stored as ISO 8601 text in UTC (fixed width, so they sort as
text) and come back as aware UTC datetimes. FTP passwords and other secrets are
never stored here.

The schema carries a version; `MIGRATIONS` lists the steps from an empty file
to the current one, and opening a file applies the missing steps.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from gpuresa.errors import UserError
from gpuresa.journal.outbox import OutboxTable
from gpuresa.journal.times import from_text, optional_text, optional_time, to_text
from gpuresa.model import Rejection, Reservation

# The reservation lifecycle: booked → preparing → running → warned → stopping
# → ended, with the side exits rejected, cancelled and failed; "removed" ends
# an orphan (a gpuresa container that no reservation explains).
STATES = (
    "booked",
    "preparing",
    "running",
    "warned",
    "stopping",
    "ended",
    "rejected",
    "cancelled",
    "failed",
    "removed",
)
# States after which nothing more happens to a reservation.
FINAL_STATES = frozenset({"ended", "rejected", "cancelled", "failed", "removed"})
RESULTS = ("ok", "failed")

# Each migration is a list of statements run in one transaction; migration N
# (counting from 1) brings the schema to version N. Append, never edit.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE reservations (
            key TEXT PRIMARY KEY,
            uid TEXT NOT NULL,
            recurrence_id TEXT,
            calendar TEXT NOT NULL,
            host TEXT NOT NULL,
            user TEXT NOT NULL,
            template TEXT NOT NULL,
            cuda TEXT,
            gpus INTEGER NOT NULL,
            start_at TEXT NOT NULL,
            end_at TEXT NOT NULL,
            email TEXT,
            summary TEXT NOT NULL DEFAULT '',
            created TEXT,
            stamp TEXT,
            tentative INTEGER NOT NULL DEFAULT 0,
            first_seen TEXT NOT NULL,
            last_seen TEXT NOT NULL
        )
        """,
        "CREATE INDEX reservations_by_user ON reservations (user)",
        """
        CREATE TABLE rejections (
            key TEXT PRIMARY KEY,
            uid TEXT NOT NULL,
            calendar TEXT NOT NULL,
            reason TEXT NOT NULL,
            user TEXT,
            email TEXT,
            start_at TEXT,
            end_at TEXT,
            first_seen TEXT NOT NULL,
            last_seen TEXT NOT NULL,
            reason_since TEXT NOT NULL
        )
        """,
        "CREATE INDEX rejections_by_user ON rejections (user)",
        """
        CREATE TABLE states (
            key TEXT PRIMARY KEY,
            state TEXT NOT NULL,
            since TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT ''
        )
        """,
        # one table for transitions and actions, so history keeps their order
        """
        CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            key TEXT NOT NULL,
            at TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('state', 'action')),
            name TEXT NOT NULL,
            previous TEXT,
            result TEXT,
            detail TEXT NOT NULL DEFAULT ''
        )
        """,
        "CREATE INDEX events_by_key ON events (key)",
        "CREATE INDEX events_by_time ON events (at, id)",
        """
        CREATE TABLE notifications (
            key TEXT NOT NULL,
            kind TEXT NOT NULL,
            at TEXT NOT NULL,
            PRIMARY KEY (key, kind)
        )
        """,
        """
        CREATE TABLE calendars (
            name TEXT PRIMARY KEY,
            last_success TEXT,
            last_error TEXT,
            checked_at TEXT NOT NULL
        )
        """,
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    (
        # e-mails to send; a row is kept once sent (or dropped) until `trim`,
        # so (key, kind) is sent once, also across restarts
        """
        CREATE TABLE outbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            key TEXT NOT NULL,
            kind TEXT,
            address TEXT NOT NULL,
            subject TEXT NOT NULL,
            body TEXT NOT NULL,
            copy_admin INTEGER NOT NULL DEFAULT 0,
            queued_at TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            last_error TEXT,
            next_try TEXT NOT NULL,
            sent_at TEXT,
            dropped_at TEXT
        )
        """,
        # a NULL kind is never deduplicated (NULLs are distinct in a UNIQUE index)
        "CREATE UNIQUE INDEX outbox_once ON outbox (key, kind)",
        "CREATE INDEX outbox_unsent ON outbox (next_try) "
        "WHERE sent_at IS NULL AND dropped_at IS NULL",
        "CREATE INDEX reservations_by_end ON reservations (end_at)",
    ),
    (
        # the object a booking came from: of two objects holding one UID, the first keeps it
        "ALTER TABLE reservations ADD COLUMN href TEXT NOT NULL DEFAULT ''",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
# what a journal of this version holds; a file that claims the version and lacks one is damaged
TABLES = frozenset(
    {
        "schema_version",
        "reservations",
        "rejections",
        "states",
        "events",
        "notifications",
        "calendars",
        "meta",
        "outbox",
    }
)
# the file and its folder: root only
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
COMPANIONS = ("-wal", "-shm")


class JournalUnusable(UserError):
    """The file is not a journal this gpuresa can use: damaged, not a database,
    or a schema that contradicts its version. Moving it aside and starting a
    fresh one is safe."""


class JournalTooNew(UserError):
    """The journal was written by a newer gpuresa: it must be kept as it is."""


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


@dataclass(frozen=True)
class CalendarStatus:
    """How fresh one calendar's view is: its last good read and its last error."""

    name: str
    last_success: datetime | None
    last_error: str | None
    checked_at: datetime


@dataclass(frozen=True)
class RejectionRecord:
    """A rejected booking as the journal keeps it: the rejection and since when."""

    rejection: Rejection
    first_seen: datetime
    last_seen: datetime
    reason_since: datetime


def rejection_notice_kind(reason: str) -> str:
    """The `mark_notified` kind for a rejection notice: "rejected:" and a hash of the reason.

    A booking rejected again for another reason gets a new notice; the same
    reason never twice.
    """
    return "rejected:" + hashlib.sha256(reason.encode("utf-8")).hexdigest()[:16]


def _damaged(error: BaseException) -> bool:
    """Whether an SQLite error says the file's content is bad (not that it is busy,
    full, read-only or missing): not a database, corrupt, or a schema that
    contradicts itself ("table … already exists" is a plain SQLITE_ERROR)."""
    name = getattr(error, "sqlite_errorname", "")
    return name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or name == "SQLITE_ERROR"


def _tighten(path: Path, mode: int) -> None:
    """Give an existing `path` exactly `mode` (nothing happens if it is missing)."""
    try:
        if (path.stat().st_mode & 0o7777) != mode:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass


def _private_file(path: Path) -> None:
    """Make `path`'s folder (0700) and the file (0600) readable by root only, before SQLite
    opens it, so the file never exists with a looser mode."""
    path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    _tighten(path.parent, DIRECTORY_MODE)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    os.close(descriptor)
    _tighten(path, FILE_MODE)
    for companion in COMPANIONS:
        _tighten(Path(f"{path}{companion}"), FILE_MODE)


class Journal(OutboxTable):
    """The state journal in one SQLite file, safe to share between threads.

    Given the file's path; creates its folder and brings its schema up to date.
    With `read_only`, opens an existing file without changing it (for
    `gpuresa status` while the daemon runs) and raises `UserError` when it is
    missing. `timeout` is how long (seconds) to wait while another process
    holds the write lock. Raises `UserError` when the file cannot be opened or
    was written by a newer gpuresa (`JournalTooNew`) and `JournalUnusable`
    when the file is damaged or is no journal. Written to, the file (with its
    -wal and -shm) gets mode 0600 and its folder 0700, also when they exist
    with looser modes. The path ":memory:" makes a journal that lives in
    memory only (a last resort when no file can be written).
    """

    def __init__(self, path: Path, *, read_only: bool = False, timeout: float = 10.0) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self.in_memory = str(path) == ":memory:"
        self._lock = threading.RLock()
        try:
            if self.in_memory:
                self._connection = sqlite3.connect(
                    ":memory:", isolation_level=None, check_same_thread=False
                )
            elif read_only:
                if not self.path.exists():
                    raise UserError(
                        f"{self.path}: no journal yet (has the daemon run with this state_dir?)"
                    )
                self._connection = sqlite3.connect(
                    f"{self.path.resolve().as_uri()}?mode=ro",
                    uri=True,
                    timeout=timeout,
                    isolation_level=None,
                    check_same_thread=False,
                )
            else:
                _private_file(self.path)
                self._connection = sqlite3.connect(
                    self.path,
                    timeout=timeout,
                    isolation_level=None,
                    check_same_thread=False,
                )
        except (sqlite3.Error, OSError) as error:
            unusable = JournalUnusable if _damaged(error) else UserError
            raise unusable(f"{self.path}: cannot open the journal: {error}") from None
        try:
            self._prepare()
        except sqlite3.Error as error:
            self._connection.close()
            # a locked, full or read-only file is not damaged: it must stay where it is
            unusable = JournalUnusable if _damaged(error) else UserError
            raise unusable(f"{self.path}: cannot use the journal: {error}") from None
        except BaseException:
            self._connection.close()
            raise
        if not read_only and not self.in_memory:
            # SQLite made the companions with the file's mode; older ones may be looser
            for companion in COMPANIONS:
                _tighten(Path(f"{self.path}{companion}"), FILE_MODE)

    # --- opening, migrations ------------------------------------------------------

    def _prepare(self) -> None:
        connection = self._connection
        if self.read_only:
            version = self._version()
            if version != SCHEMA_VERSION:
                self._refuse_version(version)
            return
        # WAL: readers in other processes never block the writer, nor it them.
        mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal" and not self.in_memory:
            raise UserError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
        # a damaged page must be found now, while the file can still be set aside
        problems = [str(row[0]) for row in connection.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise JournalUnusable(f"{self.path}: the journal is damaged: {'; '.join(problems)}")
        # a committed transition must survive a power cut, not only kill -9
        connection.execute("PRAGMA synchronous = FULL")
        with self._transaction():
            connection.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"
            )
            version = self._version()
            if version > SCHEMA_VERSION:
                self._refuse_version(version)
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[number - 1]:
                    connection.execute(statement)
            if version != SCHEMA_VERSION:
                connection.execute("DELETE FROM schema_version")
                connection.execute(
                    "INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,)
                )
            tables = {
                str(row[0])
                for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            if not tables >= TABLES:
                missing = ", ".join(sorted(TABLES - tables))
                raise JournalUnusable(
                    f"{self.path}: the journal says version {SCHEMA_VERSION} but lacks {missing}"
                )

    def _version(self) -> int:
        try:
            row = self._connection.execute("SELECT version FROM schema_version").fetchone()
        except sqlite3.OperationalError:
            # a new, empty file (or one that is not a journal yet)
            return 0
        if row is None:
            return 0
        if not isinstance(row[0], int) or row[0] < 0:
            raise JournalUnusable(f"{self.path}: the journal's schema version is {row[0]!r}")
        return row[0]

    def _refuse_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise JournalTooNew(
                f"{self.path}: the journal has schema version {version}, newer than this "
                f"gpuresa knows ({SCHEMA_VERSION}); upgrade gpuresa"
            )
        raise UserError(
            f"{self.path}: the journal has schema version {version}, expected "
            f"{SCHEMA_VERSION}; start the daemon once to upgrade it"
        )

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside BEGIN IMMEDIATE … COMMIT, under the lock; rolled back on error."""
        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self._connection
            except BaseException:
                # SQLite may have rolled back already (a full disk, say)
                if self._connection.in_transaction:
                    self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def _query(self, sql: str, parameters: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            cursor = self._connection.cursor()
            cursor.row_factory = sqlite3.Row
            return list(cursor.execute(sql, parameters))

    def close(self) -> None:
        """Close the connection; the journal cannot be used afterwards."""
        with self._lock:
            self._connection.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- reservations and rejections ---------------------------------------------

    def record_reservations(
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
        with self._transaction() as connection:
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

    def reservation(self, key: str) -> Reservation | None:
        """The reservation `key` as last seen in a calendar, or None if never seen."""
        rows = self._query("SELECT * FROM reservations WHERE key = ?", (key,))
        return _reservation(rows[0]) if rows else None

    def reservations(self, ending_after: datetime | None = None) -> list[Reservation]:
        """Every reservation seen (those ending after `ending_after` if given), by start."""
        if ending_after is None:
            rows = self._query("SELECT * FROM reservations ORDER BY start_at, key")
        else:
            rows = self._query(
                "SELECT * FROM reservations WHERE end_at > ? ORDER BY start_at, key",
                (to_text(ending_after),),
            )
        return [_reservation(row) for row in rows]

    def rejections(self, ending_after: datetime | None = None) -> list[RejectionRecord]:
        """The bookings rejected now (not fixed since), by start; those ending after
        `ending_after` (or with no known end) if given.
        """
        sql = "SELECT * FROM rejections"
        parameters: tuple[str, ...] = ()
        if ending_after is not None:
            sql += " WHERE end_at IS NULL OR end_at > ?"
            parameters = (to_text(ending_after),)
        rows = self._query(sql + " ORDER BY start_at, key", parameters)
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

    def first_seen_times(self) -> dict[str, datetime]:
        """When gpuresa first saw each booking, as a reservation or a rejection, by key.

        What decides between over-booked reservations (the one seen first
        wins): unlike CREATED, nobody can write it into an event.
        """
        rows = self._query(
            """
            SELECT key, MIN(first_seen) AS first_seen FROM (
                SELECT key, first_seen FROM reservations
                UNION ALL SELECT key, first_seen FROM rejections
            ) GROUP BY key
            """
        )
        return {str(row["key"]): from_text(row["first_seen"]) for row in rows}

    def origins(self) -> dict[str, tuple[str, str]]:
        """Where gpuresa first saw each UID as a reservation: (calendar, object href).

        What decides between copies of one UID (see `gpuresa.reservations.claims`): the
        copy in that calendar and object keeps the booking.
        """
        rows = self._query(
            "SELECT uid, calendar, href, first_seen FROM reservations ORDER BY first_seen DESC"
        )
        # the earliest row of each UID comes last, so it is the one kept
        return {str(row["uid"]): (str(row["calendar"]), str(row["href"])) for row in rows}

    def ended_times(self) -> dict[str, tuple[datetime, datetime]]:
        """The times each booking whose session ended had when it ended, by key."""
        rows = self._query(
            """
            SELECT reservations.key, start_at, end_at FROM reservations
            JOIN states ON states.key = reservations.key WHERE states.state = 'ended'
            """
        )
        return {
            str(row["key"]): (from_text(row["start_at"]), from_text(row["end_at"])) for row in rows
        }

    # --- lifecycle -----------------------------------------------------------------------

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

    # --- calendars and daemon facts ---------------------------------------------------

    def record_calendar(
        self, name: str, last_success: datetime | None, last_error: str | None, now: datetime
    ) -> None:
        """Record one attempt to read calendar `name`.

        After a good read pass `last_success` (and no error); after a failure
        pass None and the error: the previous last success is kept.
        """
        with self._transaction() as connection:
            connection.execute(
                """
                INSERT INTO calendars (name, last_success, last_error, checked_at)
                VALUES (?, ?, ?, ?)
                ON CONFLICT (name) DO UPDATE SET
                    last_success = COALESCE(excluded.last_success, calendars.last_success),
                    last_error = excluded.last_error,
                    checked_at = excluded.checked_at
                """,
                (name, optional_text(last_success), last_error, to_text(now)),
            )

    def calendars(self) -> dict[str, CalendarStatus]:
        """Every calendar's freshness, by name."""
        return {
            row["name"]: CalendarStatus(
                name=row["name"],
                last_success=optional_time(row["last_success"]),
                last_error=row["last_error"],
                checked_at=from_text(row["checked_at"]),
            )
            for row in self._query("SELECT * FROM calendars ORDER BY name")
        }

    def set_meta(self, name: str, value: str) -> None:
        """Keep a small daemon fact (last poll time, daemon pid…) under `name`."""
        with self._transaction() as connection:
            connection.execute(
                "INSERT INTO meta (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (name, value),
            )

    def get_meta(self, name: str) -> str | None:
        """The fact kept under `name`, or None."""
        rows = self._query("SELECT value FROM meta WHERE name = ?", (name,))
        return str(rows[0]["value"]) if rows else None

    def meta_with_prefix(self, prefix: str) -> dict[str, str]:
        """Every fact whose name starts with `prefix`, by the rest of its name.

        `set_meta("missing:r1", …)` comes back as {"r1": …} for prefix "missing:".
        """
        rows = self._query(
            "SELECT name, value FROM meta WHERE substr(name, 1, ?) = ? ORDER BY name",
            (len(prefix), prefix),
        )
        return {str(row["name"])[len(prefix) :]: str(row["value"]) for row in rows}

    def delete_meta(self, name: str) -> None:
        """Forget the fact kept under `name` (nothing happens if there is none)."""
        with self._transaction() as connection:
            connection.execute("DELETE FROM meta WHERE name = ?", (name,))

    # --- retention ------------------------------------------------------------------------

    def trim(self, now: datetime, retention: timedelta) -> int:
        """Forget what is older than `retention` before `now`; returns the rows deleted.

        Deleted: history rows, sent-notice claims, rejections last seen, and
        reservations (with their state) ended before the cut, and outbox
        messages sent or dropped before it. Unsent e-mails, calendars and
        daemon facts are kept. Raises ValueError for a retention of 0 or less.
        """
        if retention <= timedelta(0):
            raise ValueError(f"a retention must be longer than 0s, not {retention}")
        cut = to_text(now - retention)
        deleted = 0
        with self._transaction() as connection:
            for statement in (
                "DELETE FROM events WHERE at < ?1",
                "DELETE FROM notifications WHERE at < ?1",
                "DELETE FROM rejections WHERE last_seen < ?1 AND (end_at IS NULL OR end_at < ?1)",
                "DELETE FROM reservations WHERE end_at < ?1 AND last_seen < ?1",
                # the states of bookings forgotten above (and of orphans long removed)
                """
                DELETE FROM states WHERE since < ?1
                    AND key NOT IN (SELECT key FROM reservations)
                    AND key NOT IN (SELECT key FROM rejections)
                """,
                "DELETE FROM outbox WHERE sent_at < ?1 OR dropped_at < ?1",
            ):
                deleted += connection.execute(statement, (cut,)).rowcount
        return deleted


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
