"""The journal never keeps a session from ending: a full disk, a damaged file, modes,
retention, and the first sight that decides over-booking."""

from __future__ import annotations

import logging
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuresa.config.reporting_sections import NotifyConfig
from gpuresa.config.sections import UsersConfig
from gpuresa.errors import UserError
from gpuresa.journal.guard import GuardedJournal, damaged_name, open_journal
from gpuresa.journal.schema import SCHEMA_VERSION
from gpuresa.journal.store import Journal, JournalTooNew
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Rejection, Reservation

NOW = datetime(2024, 5, 3, 12, 0, tzinfo=UTC)


def reservation(key: str, **changes: object) -> Reservation:
    base = Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar="gpu1",
        host="gpu1",
        user="alice",
        template="pytorch",
        cuda=None,
        gpus=1,
        start=NOW + timedelta(hours=1),
        end=NOW + timedelta(hours=2),
        email="alice@example.org",
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def rejection(key: str, reason: str = "overlaps", **changes: object) -> Rejection:
    base = Rejection(
        key=key,
        uid=key,
        calendar="gpu1",
        reason=reason,
        user="bob",
        email=None,
        start=NOW,
        end=NOW + timedelta(hours=1),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- a full disk -------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs, unmounted afterwards (the tests run as root)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)], check=True
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_a_full_disk_then_a_broken_file_make_every_call_fall_back(
    tiny_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal, problem = open_journal(tiny_disk / "state" / "journal.sqlite")
    assert problem is None
    journal.states.set("r1", "running", NOW)
    journal.reservations.record([reservation("r1")], [], NOW)
    # fill the disk
    with (tiny_disk / "filler").open("wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError:
            pass
    history = "x" * 200_000
    # writes fail (the disk is full) and fall back, nothing raises
    assert journal.states.set("r1", "stopping", NOW, history) is False
    journal.history.record_action("r1", "stop", NOW, "ok", history)
    assert journal.notices.claim("r1", "end" + history, NOW) is True
    # r1's rows are old enough to go, but the deletion needs room too: none deleted
    later = NOW + timedelta(days=3)
    with caplog.at_level(logging.ERROR, logger="gpuresa.journal.guard"):
        assert journal.trim(later, timedelta(days=1)) == 0
    assert "journal trim failed (database or disk is full)" in caplog.text
    # reads still work
    assert journal.states.get("r1") == "running"
    # now the file itself breaks: reads fail too and fall back
    (tiny_disk / "filler").unlink()
    # with room again, the same trim deletes them: r1's reservation, state and event
    assert journal.trim(later, timedelta(days=1)) == 3
    journal.path.write_bytes(b"garbage " * 4096)
    Path(f"{journal.path}-wal").write_bytes(b"")
    shm = Path(f"{journal.path}-shm")
    shm.write_bytes(b"\0" * shm.stat().st_size)
    assert journal.states.get("r1") is None
    assert journal.states.all() == {}
    assert journal.reservations.all() == []
    assert journal.reservations.rejections() == []
    assert journal.reservations.get("r1") is None
    assert journal.reservations.first_seen_times() == {}
    assert journal.history.entries() == []
    assert journal.notices.claimed("r1") == {}
    assert journal.calendars.all() == {}
    assert journal.facts.get("daemon_pid") is None
    assert journal.facts.with_prefix("missing:") == {}
    assert journal.reservations.record([reservation("r2")], [rejection("x")], NOW) == []
    journal.facts.set("a", "b")
    journal.facts.delete("a")
    journal.notices.release("r1", "end")
    journal.calendars.record("gpu1", NOW, None, NOW)
    # the outbox keeps the message in memory and still counts it
    outbox = Outbox(journal, Notifier(NotifyConfig(), UsersConfig()))
    assert outbox.enqueue("r1", "end", "alice@example.org", "ended", "body")
    assert not outbox.enqueue("r1", "end", "alice@example.org", "ended", "body")
    assert outbox.backlog() == 1
    journal.close()


def test_with_no_room_for_a_journal_the_daemon_runs_on_one_in_memory(tiny_disk: Path) -> None:
    folder = tiny_disk / "state"
    folder.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    journal, problem = open_journal(folder / "journal.sqlite")
    assert problem is not None and "kept in memory" in problem
    assert journal.states.set("r1", "running", NOW)
    assert journal.states.get("r1") == "running"
    journal.close()


# --- a damaged journal -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        "not a database",
        "a schema version that contradicts its tables",
        "a version from nowhere",
    ],
)
def test_a_damaged_journal_is_moved_aside_and_a_fresh_one_made(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    if damage == "not a database":
        path.write_bytes(b"this is not SQLite " * 500)
    else:
        connection = sqlite3.connect(path)
        if damage == "a schema version that contradicts its tables":
            connection.execute("DELETE FROM schema_version")  # as after a crash mid-upgrade
        else:
            connection.execute("UPDATE schema_version SET version = 'two'")
        connection.commit()
        connection.close()
    before = path.read_bytes()
    journal, problem = open_journal(path, now=NOW)
    aside = damaged_name(path, NOW)
    assert aside.name == "journal.sqlite.damaged-20240503T120000Z"
    assert problem is not None and str(aside) in problem
    assert aside.read_bytes() == before
    # the fresh one works
    assert journal.states.set("r1", "booked", NOW)
    journal.close()
    assert Journal(path).states.get("r1") == "booked"


def test_a_journal_from_a_newer_gpuresa_is_never_moved(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    connection = sqlite3.connect(path)
    connection.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    connection.commit()
    connection.close()
    with pytest.raises(JournalTooNew, match="upgrade gpuresa"):
        open_journal(path)
    assert [item.name for item in tmp_path.iterdir() if "damaged" in item.name] == []
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT version FROM schema_version").fetchone()[0] == (
        SCHEMA_VERSION + 1
    )
    connection.close()


def test_a_busy_journal_is_not_taken_for_a_damaged_one(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(UserError) as raised:
            Journal(path, timeout=0.2)
        assert type(raised.value) is UserError
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert [item.name for item in tmp_path.iterdir() if "damaged" in item.name] == []


# --- modes --------------------------------------------------------------------------------


def test_the_journal_and_its_folder_are_for_root_only(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    path = folder / "journal.sqlite"
    Journal(path).close()
    assert mode(folder) == 0o700
    assert mode(path) == 0o600
    # loosened by hand (or made by an older gpuresa): tightened at the next opening
    folder.chmod(0o755)
    path.chmod(0o644)
    for companion in ("-wal", "-shm"):
        Path(f"{path}{companion}").touch()
        Path(f"{path}{companion}").chmod(0o666)
    journal = GuardedJournal(path)
    journal.states.set("r1", "booked", NOW)
    assert mode(folder) == 0o700
    for file in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        assert mode(file) == 0o600, file
    journal.close()


# --- retention ------------------------------------------------------------------------------


def test_trim_forgets_what_is_older_than_the_retention(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite")
    old = NOW - timedelta(days=200)
    ended = reservation("old", start=old, end=old + timedelta(hours=2))
    journal.reservations.record([ended], [rejection("old-x", start=old, end=old)], old)
    journal.states.set("old", "ended", old)
    journal.notices.claim("old", "end", old)
    assert journal.outbox.add("old", "warning", "a@example.org", "s", "b", False, old)
    [message] = journal.outbox.unsent()
    journal.outbox.mark_sent(message.id, old)
    assert journal.outbox.add("old", "unsent", "a@example.org", "s", "b", False, old)
    # recent things stay
    journal.reservations.record([reservation("new")], [rejection("new-x")], NOW)
    journal.states.set("new", "booked", NOW)
    journal.notices.claim("new", "start", NOW)

    deleted = journal.trim(NOW, timedelta(days=180))
    # the old state change, the old notices ("end", and "warning" claimed when sent), the
    # old rejection, reservation and state, the sent outbox message
    assert deleted == 7
    assert [item.key for item in journal.reservations.all()] == ["new"]
    assert [item.rejection.key for item in journal.reservations.rejections()] == ["new-x"]
    assert journal.states.all() == {"new": "booked"}
    assert [entry.key for entry in journal.history.entries()] == ["new"]
    assert journal.notices.claimed("old") == {} and "start" in journal.notices.claimed("new")
    # an e-mail never sent is kept (give_up_after drops it, not the retention)
    assert [item.kind for item in journal.outbox.unsent()] == ["unsent"]
    with pytest.raises(ValueError):
        journal.trim(NOW, timedelta(0))
    journal.close()


# --- first sight ----------------------------------------------------------------------------


def test_first_sight_spans_reservations_and_rejections(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite")
    later = NOW + timedelta(hours=1)
    # "a" was rejected first, then fixed; "b" was a reservation, then rejected
    journal.reservations.record([reservation("b")], [rejection("a")], NOW)
    journal.reservations.record([reservation("a")], [rejection("b")], later)
    journal.reservations.record([reservation("c")], [], later + timedelta(hours=1))
    assert journal.reservations.first_seen_times() == {
        "a": NOW,
        "b": NOW,
        "c": later + timedelta(hours=1),
    }
    journal.close()
