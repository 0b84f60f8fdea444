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

The schema carries a version; `gpuresa.journal.schema.MIGRATIONS` lists the
steps from an empty file to the current one, and opening a file applies the
missing steps.

A `Journal` is its tables, each an object over the one connection
(`gpuresa.journal.database.Database`): `journal.reservations`,
`journal.states`, `journal.history`, `journal.notices`, `journal.outbox`,
`journal.calendars`, `journal.facts` and `journal.writeback` (what
`gpuresa.writeback` writes back into the calendars). Every public method of a table is a
guarded read or write, so a guarded journal (the daemon's) never raises for
a journal failure, whatever the method.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.errors import UserError
from gpuresa.journal.database import Database, Table, writes
from gpuresa.journal.facts import CalendarStatus, CalendarTable, FactTable
from gpuresa.journal.history import HistoryTable, NoticeTable, StateTable
from gpuresa.journal.outbox import OutboxTable
from gpuresa.journal.reservation_records import ReservationTable
from gpuresa.journal.schema import MIGRATIONS, SCHEMA_VERSION, TABLES
from gpuresa.journal.times import to_text
from gpuresa.journal.writeback import WriteBackTable

__all__ = ["CalendarStatus", "Journal", "JournalTooNew", "JournalUnusable"]

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


class Journal:
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

    With `guarded`, no read or write of its tables ever raises: a failure is
    logged and the method's fallback returned (see `gpuresa.journal.guard`).
    """

    def __init__(
        self,
        path: Path,
        *,
        read_only: bool = False,
        timeout: float = 10.0,
        guarded: bool = False,
    ) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self.in_memory = str(path) == ":memory:"
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
        self._database = Database(self._connection, guarded=guarded)
        self.reservations = ReservationTable(self._database)
        self.states = StateTable(self._database)
        self.history = HistoryTable(self._database)
        self.notices = NoticeTable(self._database)
        self.outbox = OutboxTable(self._database)
        self.calendars = CalendarTable(self._database)
        self.facts = FactTable(self._database)
        self.writeback = WriteBackTable(self._database)
        self._retention = Retention(self._database)

    @property
    def guarded(self) -> bool:
        """Whether a failed read or write is logged and replaced by a fallback."""
        return self._database.guarded

    def tables(self) -> dict[str, Table]:
        """Every table of the journal by its attribute name (`_retention` for `trim`)."""
        return {name: value for name, value in vars(self).items() if isinstance(value, Table)}

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
        with self._opening_transaction():
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
    def _opening_transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE … COMMIT for the migrations, rolled back on error (never guarded:
        a journal that cannot be opened must say so)."""
        self._connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._connection.in_transaction:
                self._connection.execute("ROLLBACK")
            raise
        self._connection.execute("COMMIT")

    def close(self) -> None:
        """Close the connection; the journal cannot be used afterwards."""
        self._database.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def trim(self, now: datetime, retention: timedelta) -> int:
        """Forget what is older than `retention` before `now` (see `Retention.trim`)."""
        return self._retention.trim(now, retention)


class Retention(Table):
    """The journal's forgetting, across its tables; guarded, `trim` falls back to 0."""

    @writes(fallback=0)
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
        with self._database.transaction() as connection:
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
