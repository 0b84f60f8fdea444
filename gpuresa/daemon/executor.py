"""Workers for the daemon's actions: one action per session and lane, each with a deadline.

Lanes keep what must not wait apart: a session's life cycle (prepare, start,
stop) runs one action at a time; its notices (a warning shown in the session,
an extension written into it) run beside it, so a message that hangs never
holds up the stop at the end; and a forced kill runs beside a stuck stop.

Each action runs on a thread of its own (a daemon thread, so a stuck call
never keeps the process from exiting), and its result is handed back to the
loop through `post`. Threads rather than a fixed pool: an action stuck in a
Docker call that never returns would otherwise hold a pool slot, and enough of
them would starve every other session's starts. Python cannot kill a thread,
so a deadline does not cancel anything: the loop learns that the action is
overdue, reports it and escalates (a stuck stop gets a forced kill), while
the session's slot stays taken until the thread returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Outcome = object


@dataclass
class InFlight:
    """One action under way."""

    key: str
    lane: str
    what: str
    started: float
    deadline: float
    # set once the loop has handled the overrun, so it is reported once
    overdue: bool = False
    # set by the worker when `work` returned; the slot is freed on the loop thread, with
    # the outcome, so a round never sees the slot free before the outcome is taken in
    finished: bool = False
    payload: object = field(default=None, repr=False)


# the lanes of a session's actions (see the module)
LIFE_CYCLE = "life-cycle"
NOTICE = "notice"
KILL = "kill"


class Executor:
    """Runs actions off the loop; at most one per session and lane.

    `post` hands a callable to the loop thread; the executor calls it with the
    action's completion (`on_done(outcome)` or `on_done(exception)`), never
    touching the loop's state itself. `monotonic`: the loop's clock, for deadlines.
    """

    def __init__(
        self,
        post: Callable[[Callable[[], None]], None],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._post = post
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], InFlight] = {}

    def busy(self, key: str, lane: str = LIFE_CYCLE) -> bool:
        with self._lock:
            return (key, lane) in self._in_flight

    def in_flight(self, lane: str = LIFE_CYCLE) -> dict[str, InFlight]:
        """The actions under way in `lane`, by session key."""
        with self._lock:
            return {key: entry for (key, name), entry in self._in_flight.items() if name == lane}

    def all_in_flight(self) -> list[InFlight]:
        with self._lock:
            return list(self._in_flight.values())

    def submit(
        self,
        key: str,
        what: str,
        work: Callable[[], object],
        on_done: Callable[[object], None],
        timeout: float,
        *,
        payload: object = None,
        lane: str = LIFE_CYCLE,
    ) -> bool:
        """Start `work` unless `key` has an action under way in `lane`; returns whether it began.

        `on_done` runs on the loop thread with `work`'s return value, or the
        exception it raised.
        """
        slots = self._in_flight
        now = self._monotonic()
        entry = InFlight(key, lane, what, now, now + timeout, payload=payload)
        with self._lock:
            if (key, lane) in slots:
                return False
            slots[key, lane] = entry

        def finish(result: object) -> None:
            with self._lock:
                if slots.get((key, lane)) is entry:
                    del slots[key, lane]
            on_done(result)

        def run() -> None:
            try:
                result: object = work()
            except Exception as error:  # reported to the loop, which logs and retries
                result = error
            entry.finished = True
            self._post(lambda: finish(result))

        thread = threading.Thread(target=run, name=f"gpuresa-{what}-{key}"[:60], daemon=True)
        thread.start()
        return True

    def overdue(self) -> list[InFlight]:
        """Actions past their deadline not reported yet; each is returned once."""
        now = self._monotonic()
        late = []
        with self._lock:
            for entry in self._in_flight.values():
                if not entry.overdue and now > entry.deadline:
                    entry.overdue = True
                    late.append(entry)
        return late

    def running(self) -> list[InFlight]:
        """Actions whose work has not returned yet (for a shutdown)."""
        with self._lock:
            return [entry for entry in self._in_flight.values() if not entry.finished]
