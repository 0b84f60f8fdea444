"""The one clock the daemon's loop reads: wall time for the calendar, monotonic time for waits.

The loop, its periodic jobs and the executor's deadlines read both from one
object, so a test hands the loop a `ManualClock` and moves time instead of
sleeping to see that nothing more happens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Protocol


def utc_now() -> datetime:
    return datetime.now(UTC)


class Clock(Protocol):
    """Wall time (aware, UTC) and monotonic seconds."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The host's clocks; `wall` may stand in for the wall clock (a daemon's `clock`)."""

    def __init__(self, wall: Callable[[], datetime] = utc_now) -> None:
        self._wall = wall

    def now(self) -> datetime:
        return self._wall()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told: both its times move together (for tests).

    `start`: the wall time it shows first. Safe to read from any thread.
    """

    def __init__(self, start: datetime) -> None:
        self._lock = threading.Lock()
        self._wall = start
        self._monotonic = 1000.0

    def now(self) -> datetime:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def advance(self, seconds: float) -> None:
        """Move both times `seconds` on."""
        with self._lock:
            self._wall += timedelta(seconds=seconds)
            self._monotonic += seconds
