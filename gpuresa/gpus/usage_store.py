"""GPU use per booking, kept in its own SQLite file next to the journal.

A file of its own (`gpu-usage.sqlite` in the state directory) rather than
journal tables: the sampler writes every minute from its own thread, and
keeping those writes out of the journal keeps its transactions short and its
schema untouched. `gpuresa status` and `history` open it read-only.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

USAGE_FILE = "gpu-usage.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    key TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    first TEXT NOT NULL,
    last TEXT NOT NULL,
    samples INTEGER NOT NULL DEFAULT 0,
    utilization_sum REAL NOT NULL DEFAULT 0,
    memory_sum REAL NOT NULL DEFAULT 0,
    last_utilization REAL,
    last_memory REAL,
    ended TEXT
);
CREATE TABLE IF NOT EXISTS session_gpus (
    key TEXT NOT NULL,
    gpu_index INTEGER NOT NULL,
    uuid TEXT NOT NULL,
    PRIMARY KEY (key, gpu_index)
);
CREATE TABLE IF NOT EXISTS reported (
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    at TEXT NOT NULL,
    PRIMARY KEY (kind, subject)
);
"""


@dataclass(frozen=True)
class SessionUse:
    """A booking's GPU use: mean utilization (percent) and memory (bytes) over its samples."""

    key: str
    user: str
    first: datetime
    last: datetime
    samples: int
    average_utilization: float | None
    average_memory: float | None
    current_utilization: float | None
    current_memory: float | None
    ended: datetime | None


def _text(instant: datetime) -> str:
    return instant.astimezone(UTC).isoformat()


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


class UsageStore:
    """Per-session GPU use, the UUIDs each session holds, and findings already reported.

    Thread-safe (one connection behind a lock). `read_only` opens an existing
    file for the CLI while the daemon writes it; raises `sqlite3.Error` when
    the file cannot be opened.
    """

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        self._lock = threading.Lock()
        if read_only:
            uri = f"file:{path}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, timeout=10, check_same_thread=False)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, timeout=10, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        self._db.row_factory = sqlite3.Row

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add_sample(
        self, key: str, user: str, now: datetime, utilization: float | None, memory: float | None
    ) -> None:
        """Count one sample of session `key` (None: the GPUs did not say; not averaged)."""
        counted = utilization is not None
        with self._transaction() as db:
            db.execute(
                "INSERT INTO usage (key, user, first, last) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(key) DO NOTHING",
                (key, user, _text(now), _text(now)),
            )
            db.execute(
                "UPDATE usage SET last = ?, samples = samples + ?, "
                "utilization_sum = utilization_sum + ?, memory_sum = memory_sum + ?, "
                "last_utilization = ?, last_memory = ?, ended = NULL WHERE key = ?",
                (
                    _text(now),
                    1 if counted else 0,
                    utilization or 0.0,
                    (memory or 0.0) if counted else 0.0,
                    utilization,
                    memory,
                    key,
                ),
            )

    def end(self, keys: Iterable[str], now: datetime) -> None:
        """Mark sessions that no longer run as ended (their averages are final)."""
        with self._transaction() as db:
            db.executemany(
                "UPDATE usage SET ended = ? WHERE key = ? AND ended IS NULL",
                [(_text(now), key) for key in keys],
            )

    def uses(self, *, running: bool | None = None) -> dict[str, SessionUse]:
        """Every session's use by key; `running` True/False keeps only open/ended ones."""
        sql = "SELECT * FROM usage"
        if running is True:
            sql += " WHERE ended IS NULL"
        elif running is False:
            sql += " WHERE ended IS NOT NULL"
        with self._lock:
            rows = self._db.execute(sql).fetchall()
        result = {}
        for row in rows:
            samples = int(row["samples"])
            result[row["key"]] = SessionUse(
                key=row["key"],
                user=row["user"],
                first=datetime.fromisoformat(row["first"]),
                last=datetime.fromisoformat(row["last"]),
                samples=samples,
                average_utilization=row["utilization_sum"] / samples if samples else None,
                average_memory=row["memory_sum"] / samples if samples else None,
                current_utilization=row["last_utilization"],
                current_memory=row["last_memory"],
                ended=_time(row["ended"]),
            )
        return result

    def bind_gpus(self, key: str, uuids: dict[int, str]) -> None:
        """Record which GPU (UUID) each of session `key`'s indices was when first seen."""
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO session_gpus (key, gpu_index, uuid) VALUES (?, ?, ?) "
                "ON CONFLICT(key, gpu_index) DO NOTHING",
                [(key, index, uuid) for index, uuid in uuids.items()],
            )

    def bound_gpus(self) -> dict[str, dict[int, str]]:
        """The UUIDs of every session's GPUs by key, then by index."""
        with self._lock:
            rows = self._db.execute("SELECT key, gpu_index, uuid FROM session_gpus").fetchall()
        result: dict[str, dict[int, str]] = {}
        for row in rows:
            result.setdefault(row["key"], {})[int(row["gpu_index"])] = row["uuid"]
        return result

    def forget_gpus(self, key: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM session_gpus WHERE key = ?", (key,))

    def claim_report(self, kind: str, subject: str, now: datetime) -> bool:
        """True the first time (kind, subject) is claimed, False ever after: each finding once."""
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT INTO reported (kind, subject, at) VALUES (?, ?, ?) "
                "ON CONFLICT(kind, subject) DO NOTHING",
                (kind, subject, _text(now)),
            )
            return cursor.rowcount == 1


def open_usage(state_dir: Path) -> UsageStore | None:
    """The state dir's usage store opened read-only for the CLI; None when there is none yet."""
    path = state_dir / USAGE_FILE
    if not path.exists():
        return None
    try:
        return UsageStore(path, read_only=True)
    except sqlite3.Error:
        return None
