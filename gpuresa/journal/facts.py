"""The journal's calendars (each one's freshness) and daemon facts (`meta`).

Two tables of `gpuresa.journal.store.Journal`: `journal.calendars` and
`journal.facts`. Their SQL tables are made by the journal's migrations.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gpuresa.journal.database import Table, reads, writes
from gpuresa.journal.times import from_text, optional_text, optional_time, to_text


@dataclass(frozen=True)
class CalendarStatus:
    """How fresh one calendar's view is: its last good read and its last error."""

    name: str
    last_success: datetime | None
    last_error: str | None
    checked_at: datetime


class CalendarTable(Table):
    """Each calendar's last good read and last error (`journal.calendars`).

    Guarded, `record` falls back to nothing and `all` to {}.
    """

    _label = "calendars."

    @writes(fallback=None)
    def record(
        self, name: str, last_success: datetime | None, last_error: str | None, now: datetime
    ) -> None:
        """Record one attempt to read calendar `name`.

        After a good read pass `last_success` (and no error); after a failure
        pass None and the error: the previous last success is kept.
        """
        with self._database.transaction() as connection:
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

    @reads(fallback={})
    def all(self) -> dict[str, CalendarStatus]:
        """Every calendar's freshness, by name."""
        return {
            row["name"]: CalendarStatus(
                name=row["name"],
                last_success=optional_time(row["last_success"]),
                last_error=row["last_error"],
                checked_at=from_text(row["checked_at"]),
            )
            for row in self._database.query("SELECT * FROM calendars ORDER BY name")
        }


class FactTable(Table):
    """Small daemon facts by name: its pid, the sessions it is stopping… (`journal.facts`).

    Guarded, writes fall back to nothing, `get` to None and `with_prefix` to {}.
    """

    _label = "facts."

    @writes(fallback=None)
    def set(self, name: str, value: str) -> None:
        """Keep a small daemon fact (last poll time, daemon pid…) under `name`."""
        with self._database.transaction() as connection:
            connection.execute(
                "INSERT INTO meta (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (name, value),
            )

    @reads(fallback=None)
    def get(self, name: str) -> str | None:
        """The fact kept under `name`, or None."""
        rows = self._database.query("SELECT value FROM meta WHERE name = ?", (name,))
        return str(rows[0]["value"]) if rows else None

    @reads(fallback={})
    def with_prefix(self, prefix: str) -> dict[str, str]:
        """Every fact whose name starts with `prefix`, by the rest of its name.

        `set("missing:r1", …)` comes back as {"r1": …} for prefix "missing:".
        """
        rows = self._database.query(
            "SELECT name, value FROM meta WHERE substr(name, 1, ?) = ? ORDER BY name",
            (len(prefix), prefix),
        )
        return {str(row["name"])[len(prefix) :]: str(row["value"]) for row in rows}

    @writes(fallback=None)
    def delete(self, name: str) -> None:
        """Forget the fact kept under `name` (nothing happens if there is none)."""
        with self._database.transaction() as connection:
            connection.execute("DELETE FROM meta WHERE name = ?", (name,))
