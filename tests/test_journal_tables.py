"""The journal's tables: every public read and write is guarded by construction.

Each method is found by introspection and run while the database really
fails (locked by another connection, then damaged): a guarded journal must
log and return the method's fallback, never raise, and a strict one must
raise, which proves the failure was real for that method.
"""

from __future__ import annotations

import inspect
import logging
import sqlite3
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuresa.journal.database import Table, guarded_methods, reads, writes
from gpuresa.journal.guard import GuardedJournal
from gpuresa.journal.store import Journal
from gpuresa.journal.writeback import WriteBackRow
from gpuresa.model import Rejection, Reservation

NOW = datetime(2024, 5, 3, 12, 0, tzinfo=UTC)
OUTBOX_WRITES = {"outbox.add", "outbox.mark_sent", "outbox.mark_failed", "outbox.drop"}

RESERVATION = Reservation(
    key="r1",
    uid="r1",
    recurrence_id=None,
    calendar="gpu1",
    host="gpu1",
    user="alice",
    template="pytorch",
    cuda=None,
    gpus=1,
    start=NOW - timedelta(days=3),
    end=NOW - timedelta(days=2),
    email="alice@example.org",
)
REJECTION = Rejection(
    key="x1",
    uid="x1",
    calendar="gpu1",
    reason="overlaps",
    user="bob",
    email=None,
    start=NOW,
    end=NOW + timedelta(hours=1),
)
# an argument for each parameter name a table's method takes; a method with a
# new name fails the tests below until it is given one here
SAMPLES: dict[str, object] = {
    "key": "r1",
    "kind": "start",
    "now": NOW,
    "state": "ended",
    "action": "stop",
    "result": "failed",
    "error": "refused",
    "address": "alice@example.org",
    "subject": "ended",
    "body": "your session ended",
    "copy_admin": False,
    "message_id": 1,
    "next_try": NOW + timedelta(minutes=1),
    "reason": "never accepted",
    "name": "gpu1",
    "last_success": NOW,
    "last_error": None,
    "value": "42",
    "prefix": "missing:",
    "retention": timedelta(days=1),
    "reservations": [RESERVATION],
    "rejected": [REJECTION],
    "row": WriteBackRow(
        key="r1",
        calendar="gpu1",
        uid="r1",
        href="/gpuresa/gpu1/r1.ics",
        state="running",
        detail="ssh -p 2201 alice@gpu1",
        text="Running on gpu1.",
        summary="alice",
        start=NOW,
        end=NOW + timedelta(hours=1),
        queued_at=NOW,
        attempts=0,
        last_error=None,
        next_try=NOW,
        written_at=None,
    ),
    "queued_at": NOW,
    "before": NOW,
    "calendars": ["gpu1"],
}


def every_method(journal: Journal) -> Iterator[tuple[str, Callable[[], Any], str, object]]:
    """Each public method of each table of `journal`, ready to call with sample arguments:
    ("table.method", call, "read" | "write", fallback)."""
    for table_name, table in journal.tables().items():
        for method_name, (kind, fallback) in guarded_methods(table).items():
            method = getattr(table, method_name)
            arguments = {
                parameter.name: SAMPLES[parameter.name]
                for parameter in inspect.signature(method).parameters.values()
                if parameter.default is inspect.Parameter.empty
            }
            label = f"{table_name.lstrip('_')}.{method_name}"
            yield label, _bound(method, arguments), kind, fallback


def _bound(method: Callable[..., Any], arguments: dict[str, object]) -> Callable[[], Any]:
    return lambda: method(**arguments)


def fill(journal: Journal) -> None:
    """Rows for every table, so that reads have something to read."""
    journal.reservations.record([RESERVATION], [REJECTION], NOW - timedelta(days=2))
    journal.states.set("r1", "running", NOW)
    journal.history.record_action("r1", "start", NOW, "ok")
    journal.notices.claim("r1", "warning", NOW)
    assert journal.outbox.add("r1", "start", "alice@example.org", "s", "b", False, NOW)
    journal.calendars.record("gpu1", NOW, None, NOW)
    journal.facts.set("missing:r1", "since")


def dump(path: Path) -> list[tuple[Any, ...]]:
    """Every row of every table of the journal at `path`, to compare before and after."""
    connection = sqlite3.connect(path)
    try:
        names = [
            str(row[0])
            for row in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        return [
            (name, *row)
            for name in names
            for row in connection.execute(f"SELECT * FROM {name} ORDER BY 1")
        ]
    finally:
        connection.close()


@pytest.fixture
def journals(tmp_path: Path) -> Iterator[tuple[Journal, GuardedJournal]]:
    """A strict and a guarded journal on one filled file, each giving up on a lock at once."""
    path = tmp_path / "journal.sqlite"
    strict = Journal(path, timeout=0.05)
    fill(strict)
    guarded = GuardedJournal(path, timeout=0.05)
    try:
        yield strict, guarded
    finally:
        strict.close()
        guarded.close()


def test_every_table_method_is_declared_and_the_outbox_writes_are_among_them(
    journals: tuple[Journal, GuardedJournal],
) -> None:
    strict, _ = journals
    declared = {label: kind for label, _, kind, _ in every_method(strict)}
    assert {label for label, kind in declared.items() if kind == "write"} >= OUTBOX_WRITES
    assert {
        "states.set",
        "history.record_action",
        "notices.claim",
        "notices.release",
        "reservations.record",
        "calendars.record",
        "facts.set",
        "facts.delete",
        "retention.trim",
    } <= set(declared)
    # every method a table's class has is one of them (nothing public left out)
    for table_name, table in strict.tables().items():
        public = {name for name in dir(table) if not name.startswith("_")}
        assert public == set(guarded_methods(table)), table_name


def test_a_locked_database_fails_every_write_and_the_guard_catches_each(
    journals: tuple[Journal, GuardedJournal], caplog: pytest.LogCaptureFixture
) -> None:
    strict, guarded = journals
    before = dump(strict.path)
    holder = sqlite3.connect(strict.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    failed_strict: set[str] = set()
    try:
        for label, call, _, _ in every_method(strict):
            try:
                call()
            except sqlite3.OperationalError as error:
                assert "locked" in str(error), label
                failed_strict.add(label)
        for label, call, kind, fallback in every_method(guarded):
            caplog.clear()
            with caplog.at_level(logging.ERROR):
                returned = call()
            if kind == "write":
                assert returned == fallback, label
                assert (
                    f"journal {label.removeprefix('retention.')} failed (database is locked)"
                    in (caplog.text)
                ), label
            else:
                assert caplog.text == "", label  # a reader is not blocked by a writer (WAL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    declared_writes = {label for label, _, kind, _ in every_method(strict) if kind == "write"}
    # each method declared a write did try to write (its lock failed), and nothing else did
    assert failed_strict == declared_writes
    assert failed_strict >= OUTBOX_WRITES
    # a failed write leaves nothing half done
    assert dump(strict.path) == before


def test_a_damaged_file_fails_every_read_and_write_and_the_guard_catches_each(
    journals: tuple[Journal, GuardedJournal], caplog: pytest.LogCaptureFixture
) -> None:
    strict, guarded = journals
    strict.path.write_bytes(b"garbage " * 4096)
    Path(f"{strict.path}-wal").write_bytes(b"")
    shm = Path(f"{strict.path}-shm")
    shm.write_bytes(b"\0" * shm.stat().st_size)
    labels = []
    for label, call, _, _ in every_method(strict):
        with pytest.raises(sqlite3.DatabaseError):
            call()
        labels.append(label)
    assert set(labels) >= OUTBOX_WRITES | {"outbox.unsent", "outbox.backlog", "notices.was_sent"}
    for label, call, _, fallback in every_method(guarded):
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert call() == fallback, label
        assert "file is not a database" in caplog.text, label
    # a fallback is a fresh copy: what a caller adds to one never shows in the next
    unsent = guarded.outbox.unsent()
    unsent.append(unsent)  # type: ignore[arg-type]
    assert guarded.outbox.unsent() == []


def test_the_mail_outbox_keeps_what_a_guarded_journal_could_not_store(
    journals: tuple[Journal, GuardedJournal],
) -> None:
    from gpuresa.config.reporting_sections import NotifyConfig
    from gpuresa.config.sections import UsersConfig
    from gpuresa.mail.outbox import Outbox
    from gpuresa.mail.smtp import Notifier

    strict, guarded = journals
    outbox = Outbox(guarded, Notifier(NotifyConfig(), UsersConfig()), clock=lambda: NOW)
    holder = sqlite3.connect(strict.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        assert outbox.enqueue("r1", "end", "alice@example.org", "ended", "body") is True
        # the same notice again is deduplicated in memory
        assert outbox.enqueue("r1", "end", "alice@example.org", "ended", "body") is False
        # the journal's one waiting message, and the one kept in memory
        assert outbox.backlog() == 2
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert [message.kind for message in strict.outbox.unsent()] == ["start"]


# --- a table that would let a method slip past the guard is refused ----------------------------


def test_a_table_method_without_a_guard_is_refused_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match=r"Careless\.poke: .*@reads or @writes"):

        class Careless(Table):
            def poke(self) -> None:
                with self._database.transaction() as connection:
                    connection.execute("DELETE FROM meta")

    with pytest.raises(TypeError, match=r"Sly\.size: "):

        class Sly(Table):
            @property
            def size(self) -> int:
                return len(self._database.query("SELECT * FROM meta"))


def test_sql_outside_a_guarded_method_is_refused(
    journals: tuple[Journal, GuardedJournal],
) -> None:
    _, guarded = journals
    database = guarded.tables()["facts"]._database
    with pytest.raises(RuntimeError, match="would not be guarded"):
        database.query("SELECT * FROM meta")
    with pytest.raises(RuntimeError, match="would not be guarded"), database.transaction():
        pass
    assert guarded.facts.get("missing:r1") == "since"


def test_a_new_table_is_guarded_with_no_list_to_keep(
    journals: tuple[Journal, GuardedJournal], caplog: pytest.LogCaptureFixture
) -> None:
    strict, guarded = journals

    class Counters(Table):
        _label = "counters."

        @writes(fallback=-1)
        def bump(self) -> int:
            with self._database.transaction() as connection:
                connection.execute("INSERT INTO meta (name, value) VALUES ('n', '1')")
            return 1

        @reads(fallback=0)
        def count(self) -> int:
            return len(self._database.query("SELECT * FROM meta"))

    counters = Counters(guarded.tables()["facts"]._database)
    holder = sqlite3.connect(strict.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with caplog.at_level(logging.ERROR):
            assert counters.bump() == -1
        assert "journal counters.bump failed (database is locked)" in caplog.text
        assert counters.count() == 1
    finally:
        holder.execute("ROLLBACK")
        holder.close()
