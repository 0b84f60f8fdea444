"""What the loop remembers: kept across restarts where it must be, and not kept forever."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from test_plan import CONFIG, T0, booking, running

from gpuresa.daemon.memory import Remembered
from gpuresa.journal.guard import open_journal


def test_a_warning_shown_is_not_shown_again_after_a_restart(tmp_path: Path) -> None:
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    first = Remembered.load(journal)
    first.warned("a", timedelta(minutes=5), CONFIG, journal, T0)
    first.cancel_noticed("b", journal, T0)
    restarted = Remembered.load(journal)
    # the 5-minute warning and the larger 15-minute one are both past
    assert restarted.warnings_sent == {("a", 300), ("a", 900)}
    assert restarted.cancel_notified == {"b"}
    journal.close()


def test_an_extension_makes_the_warnings_due_again(tmp_path: Path) -> None:
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    remembered = Remembered.load(journal)
    remembered.warned("a", timedelta(minutes=5), CONFIG, journal, T0)
    remembered.extended("a", T0 + timedelta(minutes=10), T0, CONFIG, journal)
    # 15 minutes before the new end is past, 5 minutes before it is not
    assert remembered.warnings_sent == {("a", 900)}
    assert Remembered.load(journal).warnings_sent == {("a", 900)}
    journal.close()


def test_what_is_kept_about_a_booking_goes_with_it(tmp_path: Path) -> None:
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    remembered = Remembered.load(journal)
    reservation = booking("a")
    session = running(reservation)
    remembered.warned("a", timedelta(minutes=5), CONFIG, journal, T0)
    remembered.back_off("gone", T0)
    remembered.changes_notified.add(("a", "GPUs 1 → 2"))
    remembered.memory([reservation], [session], {}, T0, journal)
    assert ("a", 300) in remembered.warnings_sent
    assert "gone" in remembered.retry_after  # still backing off
    # later: the booking and its session are gone, the back-off is over
    later = T0 + timedelta(hours=3)
    remembered.memory([], [], {}, later, journal)
    assert remembered.warnings_sent == set()
    assert remembered.retry_after == {} and remembered.attempts == {}
    assert remembered.changes_notified == set()
    assert journal.facts.with_prefix("warned:") == {}
    journal.close()
