"""Workers for the daemon's actions: one action in flight per session, each with a deadline.

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
    what: str
    started: float
    deadline: float
    # set once the loop has handled the overrun, so it is reported once
    overdue: bool = False
    payload: object = field(default=None, repr=False)


class Executor:
    """Runs actions off the loop; at most one per key (escalations have their own slots).

    `post` hands a callable to the loop thread; the executor calls it with the
    action's completion (`on_done(outcome)` or `on_done(exception)`), never
    touching the loop's state itself.
    """

    def __init__(self, post: Callable[[Callable[[], None]], None]) -> None:
        self._post = post
        self._lock = threading.Lock()
        self._in_flight: dict[str, InFlight] = {}
        self._escalations: dict[str, InFlight] = {}

    def busy(self, key: str) -> bool:
        with self._lock:
            return key in self._in_flight

    def in_flight(self) -> dict[str, InFlight]:
        with self._lock:
            return dict(self._in_flight)

    def submit(
        self,
        key: str,
        what: str,
        work: Callable[[], object],
        on_done: Callable[[object], None],
        timeout: float,
        *,
        payload: object = None,
        escalation: bool = False,
    ) -> bool:
        """Start `work` for `key` unless an action of `key` is under way; returns whether it began.

        `on_done` runs on the loop thread with `work`'s return value, or the
        exception it raised. An escalation takes the key's second slot, so a
        forced kill can run while the stuck stop it replaces still hangs.
        """
        slots = self._escalations if escalation else self._in_flight
        now = time.monotonic()
        entry = InFlight(key, what, now, now + timeout, payload=payload)
        with self._lock:
            if key in slots:
                return False
            slots[key] = entry

        def run() -> None:
            try:
                result: object = work()
            except Exception as error:  # reported to the loop, which logs and retries
                result = error
            finally:
                with self._lock:
                    if slots.get(key) is entry:
                        del slots[key]
            self._post(lambda: on_done(result))

        thread = threading.Thread(target=run, name=f"gpuresa-{what}-{key}"[:60], daemon=True)
        thread.start()
        return True

    def overdue(self) -> list[InFlight]:
        """Actions past their deadline not reported yet; each is returned once."""
        now = time.monotonic()
        late = []
        with self._lock:
            for entry in [*self._in_flight.values(), *self._escalations.values()]:
                if not entry.overdue and now > entry.deadline:
                    entry.overdue = True
                    late.append(entry)
        return late

    def stuck(self) -> list[InFlight]:
        """Actions past their deadline that are still running."""
        with self._lock:
            return [entry for entry in self._in_flight.values() if entry.overdue]
