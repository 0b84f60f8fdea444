"""The SQLite journal: transitions, notices sent once, rejections, history, readers."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuresa.errors import UserError
from gpuresa.journal.reservation_records import rejection_notice_kind
from gpuresa.journal.schema import SCHEMA_VERSION
from gpuresa.journal.store import Journal
from gpuresa.journal.times import from_text, to_text
from gpuresa.model import Rejection, Reservation

NOW = datetime(2024, 5, 3, 12, 0, tzinfo=UTC)
PARIS_SUMMER = timezone(timedelta(hours=2))


def reservation(key: str = "r1", user: str = "alice", **changes: object) -> Reservation:
    base = Reservation(
        key=key,
        uid=key.split("@")[0],
        recurrence_id=None,
        calendar="gpu1",
        host="gpu1",
        user=user,
        template="pytorch",
        cuda="12.4",
        gpus=2,
        start=NOW + timedelta(hours=1),
        end=NOW + timedelta(hours=3),
        email=f"{user}@example.org",
        summary=f"{user} — entraînement",
        created=NOW - timedelta(days=1),
        stamp=NOW - timedelta(hours=1),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def rejection(
    key: str = "x1", reason: str = "unknown template 'tf'", user: str = "bob"
) -> Rejection:
    return Rejection(
        key=key,
        uid=key,
        calendar="gpu1",
        reason=reason,
        user=user,
        email=f"{user}@example.org",
        start=NOW + timedelta(hours=2),
        end=NOW + timedelta(hours=4),
    )


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal(tmp_path / "state" / "journal.sqlite") as opened:
        yield opened


def test_creates_its_folder_in_wal_mode_with_a_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "state" / "journal.sqlite"
    Journal(path).close()
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert connection.execute("SELECT version FROM schema_version").fetchall() == [
        (SCHEMA_VERSION,)
    ]
    connection.close()
    # opening again migrates nothing and keeps one version row
    Journal(path).close()
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT count(*) FROM schema_version").fetchone()[0] == 1
    connection.close()


def test_a_journal_from_a_newer_gpuresa_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    connection = sqlite3.connect(path)
    connection.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    connection.commit()
    connection.close()
    with pytest.raises(UserError, match="newer than this gpuresa knows"):
        Journal(path)


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    path.write_text("not SQLite " * 100)
    with pytest.raises(UserError, match="cannot use the journal"):
        Journal(path)


def test_read_only_needs_an_existing_journal(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no journal yet"):
        Journal(tmp_path / "missing.sqlite", read_only=True)


# --- lifecycle ------------------------------------------------------------------------------


def test_a_transition_is_recorded_only_when_the_state_changes(journal: Journal) -> None:
    assert journal.states.get("r1") is None
    assert journal.states.set("r1", "booked", NOW) is True
    assert journal.states.set("r1", "booked", NOW + timedelta(seconds=30)) is False
    assert journal.states.set("r1", "preparing", NOW + timedelta(minutes=1), "image present")
    assert journal.states.get("r1") == "preparing"
    assert journal.states.since("r1") == NOW + timedelta(minutes=1)
    assert journal.states.all() == {"r1": "preparing"}
    entries = journal.history.entries()
    assert [(entry.kind, entry.what, entry.detail) for entry in entries] == [
        ("state", "(new) → booked", ""),
        ("state", "booked → preparing", "image present"),
    ]


def test_unknown_states_and_results_are_programming_errors(journal: Journal) -> None:
    with pytest.raises(ValueError, match="unknown lifecycle state 'runing'"):
        journal.states.set("r1", "runing", NOW)
    with pytest.raises(ValueError, match="'ok' or 'failed'"):
        journal.history.record_action("r1", "start", NOW, "done")
    assert journal.history.entries() == []


def test_a_notice_is_claimed_once_even_after_reopening(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    with Journal(path) as journal:
        assert journal.notices.claim("r1", "start", NOW) is True
        assert journal.notices.claim("r1", "start", NOW) is False
        assert journal.notices.claim("r1", "warning-900", NOW) is True
        assert journal.notices.claim("r2", "start", NOW) is True
    # a restarted daemon: the same notices are not sent again
    with Journal(path) as journal:
        assert journal.notices.claim("r1", "start", NOW + timedelta(minutes=5)) is False
        assert journal.notices.claim("r1", "warning-900", NOW) is False
        assert journal.notices.claim("r1", "warning-300", NOW) is True
        assert journal.notices.claimed("r1") == {
            "start": NOW,
            "warning-900": NOW,
            "warning-300": NOW,
        }


def test_a_claim_can_be_forgotten_so_a_failed_notice_is_sent_again(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    with Journal(path) as journal:
        assert journal.notices.claim("r1", "start", NOW) is True
        assert journal.notices.claim("r1", "end", NOW) is True
        journal.notices.release("r1", "start")  # the e-mail could not be sent
        journal.notices.release("r1", "never-claimed")  # nothing to forget: no error
        assert journal.notices.claimed("r1") == {"end": NOW}
    # forgotten for good: a restarted daemon claims it again, and only that one
    with Journal(path) as journal:
        assert journal.notices.claim("r1", "start", NOW + timedelta(minutes=1)) is True
        assert journal.notices.claim("r1", "end", NOW) is False
        assert journal.notices.claim("r1", "start", NOW) is False


def test_rejection_notice_kind_follows_the_reason() -> None:
    first = rejection_notice_kind("unknown template 'tf'")
    assert first.startswith("rejected:")
    assert first == rejection_notice_kind("unknown template 'tf'")
    assert first != rejection_notice_kind("more GPUs than gpu1 has")


# --- reservations and rejections -----------------------------------------------------------


def test_reservations_round_trip_and_keep_their_first_sight(journal: Journal) -> None:
    # given in another zone: stored in UTC, returned as aware UTC
    original = reservation(
        start=datetime(2024, 5, 3, 15, 0, tzinfo=PARIS_SUMMER),
        end=datetime(2024, 5, 3, 17, 30, tzinfo=PARIS_SUMMER),
    )
    journal.reservations.record([original], [], NOW)
    stored = journal.reservations.get("r1")
    assert stored == original
    assert stored is not None and stored.start.tzinfo is UTC and stored.end.tzinfo is UTC
    assert stored.start == datetime(2024, 5, 3, 13, 0, tzinfo=UTC)
    moved = replace(original, end=original.end + timedelta(hours=1), gpus=1)
    journal.reservations.record([moved], [], NOW + timedelta(minutes=1))
    assert journal.reservations.get("r1") == moved
    assert journal.reservations.get("unknown") is None
    assert journal.reservations.all() == [moved]
    assert journal.reservations.all(ending_after=moved.end) == []


def test_only_new_or_changed_rejections_are_returned(journal: Journal) -> None:
    first = rejection(reason="unknown template 'tf'")
    assert journal.reservations.record([], [first], NOW) == [first]
    # the next polls see the same rejection: nothing to announce
    assert journal.reservations.record([], [first], NOW + timedelta(seconds=30)) == []
    assert journal.reservations.record([], [first], NOW + timedelta(seconds=60)) == []
    # the user edits the booking and gets another reason: announce it
    second = rejection(reason="more GPUs than gpu1 has (8 > 4)")
    assert journal.reservations.record([], [second], NOW + timedelta(minutes=2)) == [second]
    [record] = journal.reservations.rejections()
    assert record.rejection == second
    assert record.first_seen == NOW
    assert record.last_seen == NOW + timedelta(minutes=2)
    assert record.reason_since == NOW + timedelta(minutes=2)


def test_a_fixed_booking_is_no_longer_rejected(journal: Journal) -> None:
    journal.reservations.record([], [rejection(key="k")], NOW)
    journal.reservations.record([reservation(key="k", user="bob")], [], NOW + timedelta(minutes=1))
    assert journal.reservations.rejections() == []
    # broken again, for the same reason: a new rejection to announce
    assert journal.reservations.record([], [rejection(key="k")], NOW + timedelta(minutes=2)) == [
        rejection(key="k")
    ]


def test_rejections_can_be_limited_to_those_not_over(journal: Journal) -> None:
    past = replace(rejection(key="old"), start=NOW - timedelta(days=2), end=NOW - timedelta(days=1))
    undated = replace(rejection(key="undated"), start=None, end=None)
    journal.reservations.record([], [past, rejection(key="soon"), undated], NOW)
    keys = [record.rejection.key for record in journal.reservations.rejections(ending_after=NOW)]
    assert sorted(keys) == ["soon", "undated"]
    assert len(journal.reservations.rejections()) == 3


# --- history --------------------------------------------------------------------------------


def test_history_per_user_newest_last(journal: Journal) -> None:
    journal.reservations.record(
        [reservation("a1", "alice"), reservation("b1", "bob")], [rejection("x1", user="carol")], NOW
    )
    journal.states.set("a1", "booked", NOW)
    journal.states.set("b1", "booked", NOW + timedelta(seconds=1))
    journal.history.record_action("a1", "start", NOW + timedelta(minutes=1), "ok")
    journal.states.set("a1", "running", NOW + timedelta(minutes=1))
    journal.history.record_action(
        "b1", "start", NOW + timedelta(minutes=2), "failed", "no GPU free"
    )
    journal.states.set("x1", "rejected", NOW + timedelta(minutes=3), "unknown template 'tf'")
    journal.states.set("orphan", "stopping", NOW + timedelta(minutes=4))

    alice = journal.history.entries(user="alice")
    assert [(entry.key, entry.what) for entry in alice] == [
        ("a1", "(new) → booked"),
        ("a1", "start: ok"),
        ("a1", "booked → running"),
    ]
    assert {entry.user for entry in alice} == {"alice"}
    [failed] = [entry for entry in journal.history.entries(user="bob") if entry.kind == "action"]
    assert (failed.what, failed.detail, failed.at) == (
        "start: failed",
        "no GPU free",
        NOW + timedelta(minutes=2),
    )
    # a rejected booking's user comes from the rejection
    assert [entry.key for entry in journal.history.entries(user="carol")] == ["x1"]
    everything = journal.history.entries()
    assert [entry.at for entry in everything] == sorted(entry.at for entry in everything)
    assert everything[-1].key == "orphan" and everything[-1].user is None
    # the limit keeps the newest
    assert [entry.key for entry in journal.history.entries(limit=2)] == ["x1", "orphan"]


# --- calendars and meta ---------------------------------------------------------------------


def test_calendar_freshness_keeps_the_last_success_across_errors(journal: Journal) -> None:
    journal.calendars.record("gpu1", NOW, None, NOW)
    journal.calendars.record(
        "gpu1", None, "HTTP 503 from calendar.example.org", NOW + timedelta(minutes=1)
    )
    status = journal.calendars.all()["gpu1"]
    assert status.last_success == NOW
    assert status.last_error == "HTTP 503 from calendar.example.org"
    assert status.checked_at == NOW + timedelta(minutes=1)
    journal.calendars.record("gpu1", NOW + timedelta(minutes=2), None, NOW + timedelta(minutes=2))
    status = journal.calendars.all()["gpu1"]
    assert (status.last_success, status.last_error) == (NOW + timedelta(minutes=2), None)


def test_meta_holds_small_facts(journal: Journal) -> None:
    assert journal.facts.get("pid") is None
    journal.facts.set("pid", "1234")
    journal.facts.set("pid", "5678")
    assert journal.facts.get("pid") == "5678"
    journal.facts.delete("pid")
    journal.facts.delete("never-set")
    assert journal.facts.get("pid") is None


def test_meta_by_prefix_gives_the_rest_of_each_name(journal: Journal) -> None:
    journal.facts.set("missing:r1", "2024-05-03T12:00:00+00:00")
    journal.facts.set("missing:r2@20240503", "")
    journal.facts.set("missingno", "not under the prefix")
    # LIKE wildcards in a prefix are taken literally
    journal.facts.set("a%b:x", "1")
    journal.facts.set("aXb:y", "2")
    assert journal.facts.with_prefix("missing:") == {
        "r1": "2024-05-03T12:00:00+00:00",
        "r2@20240503": "",
    }
    assert journal.facts.with_prefix("a%b:") == {"x": "1"}


# --- time --------------------------------------------------------------------------------


def test_naive_datetimes_are_refused(journal: Journal) -> None:
    with pytest.raises(ValueError, match="naive datetime"):
        journal.states.set("r1", "booked", datetime(2024, 5, 3, 12, 0))


@given(
    st.datetimes(
        min_value=datetime(1970, 1, 2),
        max_value=datetime(9999, 12, 30),
        timezones=st.sampled_from([UTC, PARIS_SUMMER, timezone(timedelta(hours=-9, minutes=-30))]),
    ),
    st.datetimes(
        min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)
    ),
)
def test_stored_instants_round_trip_and_sort_as_text(first: datetime, second: datetime) -> None:
    back = from_text(to_text(first))
    assert back == first and back.tzinfo is UTC
    assert (to_text(first) < to_text(second)) == (first < second)


# --- sharing the file -----------------------------------------------------------------------


def test_another_process_reads_what_the_daemon_committed(journal: Journal) -> None:
    journal.reservations.record([reservation()], [], NOW)
    journal.states.set("r1", "running", NOW)
    journal.calendars.record("gpu1", NOW, None, NOW)
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from gpuresa.journal.store import Journal\n"
        "with Journal(Path(sys.argv[1]), read_only=True) as journal:\n"
        "    print(json.dumps({'states': journal.states.all(),\n"
        "        'calendar': journal.calendars.all()['gpu1'].last_success.isoformat(),\n"
        "        'user': journal.reservations.get('r1').user}))\n"
    )
    # the daemon's connection stays open meanwhile, as in production
    output = subprocess.run(
        [sys.executable, "-c", script, str(journal.path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert json.loads(output) == {
        "states": {"r1": "running"},
        "calendar": NOW.isoformat(),
        "user": "alice",
    }


def test_a_reader_is_not_blocked_by_a_writer_in_progress(journal: Journal) -> None:
    journal.states.set("r1", "booked", NOW)
    writer = sqlite3.connect(journal.path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE states SET state = 'running' WHERE key = 'r1'")
    try:
        started = time.monotonic()
        with Journal(journal.path, read_only=True) as reader:
            # sees the last committed state, at once
            assert reader.states.all() == {"r1": "booked"}
        assert time.monotonic() - started < 2
    finally:
        writer.execute("COMMIT")
        writer.close()
    with Journal(journal.path, read_only=True) as reader:
        assert reader.states.all() == {"r1": "running"}


def test_threads_share_one_journal(journal: Journal) -> None:
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for step in range(20):
                at = NOW + timedelta(seconds=step)
                journal.history.record_action(f"t{index}", "poll", at, "ok")
                journal.notices.claim(f"t{index}", f"kind-{step % 5}", at)
                journal.states.set(f"t{index}", "running" if step % 2 else "booked", at)
                journal.history.entries(limit=5)
        except BaseException as error:  # reported below, on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert len(journal.history.entries(limit=10_000)) == 8 * (20 + 20)
    assert all(len(journal.notices.claimed(f"t{index}")) == 5 for index in range(8))
