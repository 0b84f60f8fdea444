"""Reads what a usage report needs from the journal and the GPU usage store (the I/O edge).

Each query is bounded by the period and the host, so a report of a week
reads that week's rows, whatever the journal's age: bookings through the
index on `reservations (host, end_at)` (a journal holds the bookings of every
host its calendars show), their events through `events_by_key`, each
session's telemetry through the usage table's primary key. Both files are
opened read-only (SQLite's `mode=ro`), so the daemon may write them
meanwhile (WAL).

What the journal does not say in a column is derived here, once:

- a booking counts as withdrawn when its state is cancelled or rejected (from
  that moment), or when it vanished from its calendar before it started (its
  last sighting is older than the calendar's last good read);
- the GPUs a session ran on come from its journaled start action.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.errors import UserError
from gpuresa.journal.times import from_text, to_text
from gpuresa.reports.usage import (
    WITHDRAWN_STATES,
    Booking,
    Holding,
    Period,
    Refusal,
    Telemetry,
    UsageFacts,
    start_gpus,
)

# the daemon's journal in its state dir (`gpuresa.daemon.service.journal_path`, which a
# test holds this to): named here so that a report does not import the whole daemon
JOURNAL_FILE = "journal.sqlite"

# a booking missing from its calendar's good reads this long is gone (the reads of one
# poll and the booking's sighting may be dated a moment apart)
UNSEEN = timedelta(minutes=10)

# a session may hold its GPUs a little past its booking (the stop's grace, a slow
# engine): bookings that ended this long before the period still give their events
OVERRUN = timedelta(days=1)

_BOOKINGS = """
SELECT r.key, r.user, r.host, r.gpus, r.start_at, r.end_at, r.last_seen,
    s.state, s.since, c.last_success
FROM reservations AS r
LEFT JOIN states AS s ON s.key = r.key
LEFT JOIN calendars AS c ON c.name = r.calendar
WHERE r.end_at > ?1 AND r.start_at < ?2 AND r.host = ?3
"""
# Each booking's state changes and start actions. CROSS JOIN keeps SQLite from scanning
# all events in time order: the period's bookings first (reservations_by_host_end), then
# each one's events (events_by_key). Warned and stopping neither begin nor end a
# holding (`usage.HOLDING_STATES`): left out.
_EVENTS = """
SELECT e.key, e.at, e.id, e.kind, e.name FROM reservations AS r
CROSS JOIN events AS e ON e.key = r.key
WHERE r.end_at > ?1 AND r.start_at < ?2 AND r.host = ?3
    AND ((e.kind = 'state' AND e.name NOT IN ('warned', 'stopping'))
        OR (e.kind = 'action' AND e.name LIKE 'start %'))
"""
_REFUSALS = """
SELECT key, user, calendar, reason, COALESCE(start_at, first_seen) AS at FROM rejections
WHERE COALESCE(start_at, first_seen) >= ?1 AND COALESCE(start_at, first_seen) < ?2
"""
_TELEMETRY = """
SELECT key, samples, utilization_sum FROM usage
WHERE key IN (SELECT value FROM json_each(?1))
"""


def _open(path: Path, what: str) -> sqlite3.Connection:
    if not path.exists():
        raise UserError(f"{path}: no {what} yet (has the daemon run with this state_dir?)")
    try:
        return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as error:
        raise UserError(f"{path}: cannot open the {what}: {error}") from None


def _withdrawn(row: sqlite3.Row) -> datetime | None:
    if row["state"] in WITHDRAWN_STATES and row["since"] is not None:
        return from_text(row["since"])
    # deleted from its calendar before it started: nothing ever cancelled it
    if row["state"] not in (None, "booked") or row["last_success"] is None:
        return None
    last_seen = from_text(row["last_seen"])
    if last_seen < from_text(row["start_at"]) and (
        last_seen < from_text(row["last_success"]) - UNSEEN
    ):
        return last_seen
    return None


def _holdings(rows: list[tuple[str, int, str, str]]) -> list[Holding]:
    """One key's holdings from its events in order: `usage.held_intervals` (the definition,
    which a test holds this to), on the stored text, parsing only the instants kept."""
    found: list[Holding] = []
    opened: str | None = None
    for instant, _, kind, name in rows:
        if kind != "state":
            continue
        if name == "running":
            if opened is None:
                opened = instant
        elif opened is not None:
            found.append(Holding(from_text(opened), from_text(instant), name))
            opened = None
    if opened is not None:
        found.append(Holding(from_text(opened), None, None))
    return found


def read_journal(
    connection: sqlite3.Connection,
    period: Period,
    host: str,
    calendar_hosts: Mapping[str, str | None],
) -> UsageFacts:
    """The bookings of `host` that meet `period`, their sessions' holdings, the refusals.

    `calendar_hosts`: each calendar's host (None: its events name the host); a
    refusal from another host's calendar is left out, one from a calendar that
    names no host is counted under the calendar's name. Raises `sqlite3.Error`.
    """
    bounds = (to_text(period.start - OVERRUN), to_text(period.end), host)
    events: dict[str, list[tuple[str, int, str, str]]] = {}
    connection.row_factory = None
    for key, instant, number, kind, name in connection.execute(_EVENTS, bounds):
        events.setdefault(key, []).append((instant, number, kind, name))
    holdings: dict[str, list[Holding]] = {}
    started: dict[str, tuple[int, ...]] = {}
    for key, rows in events.items():
        rows.sort()  # in time order (stored instants sort as text), then journal order
        holdings_of = _holdings(rows)
        if holdings_of:
            holdings[key] = holdings_of
        starts = [name for _, _, kind, name in rows if kind == "action"]
        if starts and (gpus := start_gpus(starts[-1])):
            started[key] = gpus
    connection.row_factory = sqlite3.Row
    bookings = [
        Booking(
            key=row["key"],
            user=row["user"],
            host=row["host"],
            gpus=int(row["gpus"]),
            start=from_text(row["start_at"]),
            end=from_text(row["end_at"]),
            withdrawn_at=_withdrawn(row),
            gpu_indices=started.get(row["key"], ()),
        )
        for row in connection.execute(_BOOKINGS, bounds)
    ]
    refusals = []
    for row in connection.execute(_REFUSALS, (to_text(period.start), to_text(period.end))):
        calendar = str(row["calendar"])
        if calendar in calendar_hosts and calendar_hosts[calendar] not in (None, host):
            continue  # that host's own report counts it
        refusals.append(
            Refusal(
                key=row["key"],
                user=row["user"],
                host=calendar_hosts.get(calendar) or f"calendar {calendar}",
                reason=row["reason"],
                at=from_text(row["at"]),
            )
        )
    return UsageFacts(bookings=bookings, holdings=holdings, refusals=refusals)


def read_telemetry(connection: sqlite3.Connection, keys: list[str]) -> dict[str, Telemetry]:
    """The usage store's figures of the sessions `keys`. Raises `sqlite3.Error`."""
    found = {}
    for key, samples, utilization_sum in connection.execute(_TELEMETRY, (json.dumps(keys),)):
        count = int(samples)
        found[str(key)] = Telemetry(
            str(key), count, float(utilization_sum) / count if count else None
        )
    return found


def read_facts(
    journal_file: Path,
    usage_file: Path | None,
    period: Period,
    host: str,
    calendar_hosts: Mapping[str, str | None],
) -> UsageFacts:
    """Everything a report of `host` over `period` needs, from both files.

    `usage_file` None or missing: no telemetry (every held hour unmeasured).
    Raises `UserError` when the journal is missing or cannot be read.
    """
    connection = _open(journal_file, "journal")
    try:
        facts = read_journal(connection, period, host, calendar_hosts)
    except sqlite3.Error as error:
        raise UserError(f"{journal_file}: cannot read the journal: {error}") from None
    finally:
        connection.close()
    if usage_file is None or not usage_file.exists():
        return facts
    usage = _open(usage_file, "GPU usage store")
    try:
        telemetry = read_telemetry(usage, [booking.key for booking in facts.bookings])
    except sqlite3.Error as error:
        raise UserError(f"{usage_file}: cannot read the GPU usage store: {error}") from None
    finally:
        usage.close()
    return UsageFacts(facts.bookings, facts.holdings, telemetry, facts.refusals)
