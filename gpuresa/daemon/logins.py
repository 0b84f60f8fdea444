"""Whether anyone logged into the sessions that are released when nobody does.

Only sessions that `release_unused` watches, that run, and that no login was
seen in yet are asked about (`runtime.used`: the backend reads its session's
own logs, see each backend), every `CHECK_EVERY` seconds, off the loop: an
engine that hangs delays no round. A session once seen used stays so (a
journal fact, `Remembered.seen_used`), so it is asked about no more. What the
backend cannot tell (None) and a check that fails tell nothing: a session is
released only on the backend's word, given in a check that began at or after
its release time, that nobody logged in (`Remembered.unused_seen`; see
`gpuresa.planning.release`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime

from gpuresa.daemon.memory import Remembered
from gpuresa.daemon.periodic import Periodic
from gpuresa.daemon.tools import Tools
from gpuresa.model import Reservation, Session
from gpuresa.planning.release import release_times

log = logging.getLogger(__name__)

# how often the watched sessions' logs are read: a login shortly before the release is
# seen in time (the planner rounds at the release instant plan with what was seen)
CHECK_EVERY = 5.0


class LoginWatch:
    """The sessions whose first login is awaited, and the checks of their logs."""

    def __init__(self, tools: Tools, remembered: Remembered, plan: Callable[[], None]) -> None:
        self.tools = tools
        self.remembered = remembered
        # asks for a round: what a check found may release a session now
        self.plan = plan
        self.job = Periodic("logins", lambda: CHECK_EVERY)
        self.watched: frozenset[str] = frozenset()

    def follow(self, reservations: Iterable[Reservation], sessions: Iterable[Session]) -> None:
        """Watch the running sessions whose release is pending (after each round)."""
        config = self.tools.context.config
        running = {session.key for session in sessions if session.state == "running"}
        self.watched = frozenset(
            reservation.key
            for reservation in reservations
            if reservation.key in running
            and reservation.key not in self.remembered.used
            and release_times(reservation, config) is not None
        )

    def tick(self, now: float) -> None:
        """Begin a check of the watched sessions when one is due at monotonic `now`."""
        if not self.watched or not self.job.due(now):
            return
        run = self.job.begin(now)
        runtime = self.tools.context.runtime
        keys = sorted(self.watched)
        began = self.tools.clock.now()

        def work() -> dict[str, bool | None]:
            return {key: runtime.used(key) for key in keys}

        self.tools.background("logins", work, self._checked(run, began))

    def _checked(
        self, run: int, began: datetime
    ) -> Callable[[dict[str, bool | None] | Exception], None]:
        def done(result: dict[str, bool | None] | Exception) -> None:
            self.job.finish(self.tools.clock.monotonic())
            if not self.job.is_current(run):
                return
            if isinstance(result, Exception):
                log.warning("reading the sessions' logins failed: %s", result)
                return
            context = self.tools.context
            for key, used in result.items():
                if used:
                    log.info("%s: used (a login was seen)", key)
                    self.remembered.seen_used(key, context.journal, self.tools.clock.now())
                elif used is False:
                    self.remembered.unused_seen[key] = began
                # None: the backend cannot tell now (its log emptied, the session between
                # states): nothing is noted, so nothing is released on it
            self.watched = self.watched - {key for key, used in result.items() if used}
            if any(key in self.remembered.release_notified for key in result):
                self.plan()  # a release may be due on what was seen

        return done
