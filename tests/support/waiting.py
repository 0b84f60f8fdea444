"""Waiting for a condition in a test, with one order of arguments everywhere.

A test never sleeps a fixed time: on a loaded machine any fixed time can be
too short. It waits for what it wants to see (`wait_for`), or, to show that
something does not happen, for evidence that the daemon had its chances
(`polls_later`), or moves an injected clock (`gpuresa.daemon.clock`).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

import pytest

from gpuresa.config.sections import Config
from gpuresa.journal.times import from_text

Value = TypeVar("Value")

NEVER = datetime.min.replace(tzinfo=UTC)


def wait_for(
    condition: Callable[[], Value | None], timeout: float, what: str, *, every: float = 0.1
) -> Value:
    """Poll `condition` until it returns something true, and return that.

    Fails the test, naming `what`, when `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def last_poll(config: Config) -> datetime:
    """When the daemon of `config` began its last poll that every calendar has recorded.

    Read from its journal (read-only, as `gpuresa status` reads it); `NEVER`
    while no poll has been recorded or the journal cannot be read.
    """
    uri = f"file:{config.daemon.state_dir / 'journal.sqlite'}?mode=ro"
    rows: list[tuple[str]] = []
    with contextlib.suppress(sqlite3.Error):
        connection = sqlite3.connect(uri, uri=True, timeout=5)
        try:
            rows = connection.execute("SELECT checked_at FROM calendars").fetchall()
        finally:
            connection.close()
    return min((from_text(row[0]) for row in rows), default=NEVER)


def polls_later(config: Config, count: int = 2, *, timeout: float = 60) -> None:
    """Return once the daemon of `config` has begun and recorded `count` more calendar polls.

    Each poll is followed by a round of planning: what a test finds unchanged
    afterwards had `count` chances to change. Fails the test when a poll
    takes more than `timeout` seconds to come.
    """
    for number in range(1, count + 1):
        _poll_after(config, datetime.now(UTC), timeout, f"calendar poll {number} of {count}")


def _poll_after(config: Config, since: datetime, timeout: float, what: str) -> None:
    wait_for(lambda: last_poll(config) > since, timeout, what)
