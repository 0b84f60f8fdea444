"""The journal's schema: the reservation lifecycle's states and the migrations that make its tables.

`MIGRATIONS` lists the steps from an empty file to the current schema
(`SCHEMA_VERSION`); `gpuresa.journal.store.Journal` applies the missing ones
when it opens a file and checks that `TABLES` are there.
"""

from __future__ import annotations

# The reservation lifecycle: booked → preparing → running → warned → stopping
# → ended, with the side exits rejected, cancelled and failed; "removed" ends
# an orphan (a gpuresa container that no reservation explains); "preempted"
# ends a preemptible session that gave its GPUs to a firm booking; "released", a
# firm session nobody logged into in time (`release_unused`).
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
    "preempted",
    "released",
)
# States after which nothing more happens to a reservation.
FINAL_STATES = frozenset(
    {"ended", "rejected", "cancelled", "failed", "removed", "preempted", "released"}
)
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
    (
        # what gpuresa writes back into the calendars (`gpuresa.writeback`): one row per
        # booking, the latest state to write; kept once written, so a state is written once
        """
        CREATE TABLE writeback (
            key TEXT PRIMARY KEY,
            calendar TEXT NOT NULL,
            uid TEXT NOT NULL,
            href TEXT NOT NULL DEFAULT '',
            state TEXT NOT NULL,
            detail TEXT NOT NULL,
            text TEXT NOT NULL,
            summary TEXT NOT NULL DEFAULT '',
            start_at TEXT,
            end_at TEXT,
            queued_at TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            last_error TEXT,
            next_try TEXT NOT NULL,
            written_at TEXT
        )
        """,
        "CREATE INDEX writeback_unwritten ON writeback (next_try) WHERE written_at IS NULL",
    ),
    (
        # usage reports read one host's bookings of a period (`gpuresa.reports.reading`):
        # without the host, a journal that holds other hosts' bookings is read in full
        "CREATE INDEX reservations_by_host_end ON reservations (host, end_at)",
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
        "writeback",
    }
)
