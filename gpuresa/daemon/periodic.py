"""Periodic jobs of the loop as typed records, each deciding with a pure `due(now)`.

Modelled on APScheduler 4's triggers: a job knows when it is next due, and
whether a run of it is under way; the loop asks `due(monotonic)` each turn,
`begin()`s the run and, when its result comes back, `finish(monotonic)` sets
the next time from the interval of that moment (a reload may change it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Periodic:
    """One job run every `every()` seconds, never twice at once.

    `next_at`: monotonic time of its next run. `run`: counts the runs begun,
    so a result from a run given up on (`abandon`) is told from the current one.
    """

    name: str
    every: Callable[[], float]
    next_at: float = 0.0
    running: bool = False
    began_at: float = 0.0
    run: int = 0

    def due(self, now: float) -> bool:
        """Whether a run should begin at monotonic time `now` (pure)."""
        return not self.running and now >= self.next_at

    def overran(self, now: float, limit: float) -> bool:
        """Whether the run under way has taken more than `limit` seconds (pure)."""
        return self.running and now - self.began_at > limit

    def begin(self, now: float) -> int:
        """Mark a run as begun at `now`; returns its number."""
        self.running = True
        self.began_at = now
        self.run += 1
        return self.run

    def is_current(self, run: int) -> bool:
        return run == self.run

    def finish(self, now: float, after: float | None = None) -> None:
        """The run ended at `now`: next due `after` seconds on (default: `every()`)."""
        self.running = False
        self.next_at = now + (self.every() if after is None else after)

    def abandon(self) -> None:
        """Give the run under way up: due again at its time; its late result is not current."""
        self.running = False
        self.run += 1
