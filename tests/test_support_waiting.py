"""The tests' waits: `polls_later` reads a real journal, as the daemon writes it.

What a test shows "does not happen" rests on this wait: a helper that
returned before the daemon polled again would make those tests pass for
nothing, so it is shown returning only after new polls, and failing when
none come.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.configs import config_of
from support.waiting import NEVER, last_poll, polls_later

from gpuresa.config.sections import Config
from gpuresa.journal.store import Journal


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return config_of({"daemon": {"state_dir": str(tmp_path)}})


@pytest.fixture
def journal(config: Config) -> Iterator[Journal]:
    opened = Journal(config.daemon.state_dir / "journal.sqlite")
    yield opened
    opened.close()


def test_the_last_poll_is_the_oldest_calendars_and_never_without_a_journal(
    config: Config, journal: Journal
) -> None:
    assert last_poll(config_of({"daemon": {"state_dir": "/nonexistent/state"}})) == NEVER
    assert last_poll(config) == NEVER  # a journal, no poll yet
    earlier = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
    journal.calendars.record("lab", earlier, None, earlier)
    journal.calendars.record("gpu", None, "unreachable", earlier + timedelta(seconds=5))
    # a failed read is a poll too; both calendars are polled together, the older counts
    assert last_poll(config) == earlier


def test_polls_later_returns_only_after_new_polls(config: Config, journal: Journal) -> None:
    journal.calendars.record("lab", None, None, datetime.now(UTC) - timedelta(seconds=1))
    polled: list[datetime] = []
    stop = threading.Event()

    def daemon() -> None:
        # a poll every 0.2 s, each recorded with the moment it began
        writer = Journal(config.daemon.state_dir / "journal.sqlite")
        try:
            while not stop.wait(0.2):
                began = datetime.now(UTC)
                writer.calendars.record("lab", began, None, began)
                polled.append(began)
        finally:
            writer.close()

    thread = threading.Thread(target=daemon)
    since = datetime.now(UTC)
    thread.start()
    try:
        polls_later(config, 3, timeout=10)
    finally:
        stop.set()
        thread.join()
    assert len([moment for moment in polled if moment > since]) >= 3


def test_polls_later_fails_the_test_when_no_poll_comes(config: Config, journal: Journal) -> None:
    # a daemon that stopped polling: its last poll is old
    journal.calendars.record("lab", None, None, datetime.now(UTC) - timedelta(seconds=1))
    with pytest.raises(pytest.fail.Exception, match="calendar poll 1 of 2"):
        polls_later(config, 2, timeout=0.5)
