"""Periodic duties off the loop: the journal's trim and the engine's leftovers; the outputs.

Maintenance trims the journal and removes what no session owns any more,
once an hour. The outputs duty keeps the output service running, sends
removal notices and prunes old outputs, every ten minutes, and first soon
after a start: sessions may end any minute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from gpuresa.daemon.periodic import Periodic
from gpuresa.daemon.tools import Tools
from gpuresa.model import Session

log = logging.getLogger(__name__)

# How often the journal is trimmed and the engine's leftovers collected.
MAINTENANCE_EVERY = timedelta(hours=1)
# The first maintenance, this long after a start.
MAINTENANCE_FIRST = 60.0
# How often the output service is checked, removal notices sent and outputs pruned.
OUTPUTS_EVERY = timedelta(minutes=10)
# The first outputs duty, this long after a start.
OUTPUTS_FIRST = 2.0


class Housekeeping:
    """The maintenance and outputs jobs; `sessions()` gives the sessions last seen."""

    def __init__(self, tools: Tools, sessions: Callable[[], list[Session]]) -> None:
        self.tools = tools
        self.sessions = sessions
        started = tools.clock.monotonic()
        self.maintenance = Periodic(
            "maintenance", MAINTENANCE_EVERY.total_seconds, started + MAINTENANCE_FIRST
        )
        self.outputs = Periodic("outputs", OUTPUTS_EVERY.total_seconds, started + OUTPUTS_FIRST)
        # the logins of the sessions the last outputs round saw: a session of another
        # login brings the round forward, so that the output service knows its login
        # before the session ends (SFTP right after the end, not at the next round)
        self.outputs_logins: frozenset[str] = frozenset()

    def tick(self, now: float) -> None:
        """Begin what is due at monotonic `now`."""
        if self.outputs.due(now) or (not self.outputs.running and self._new_logins()):
            self._begin_outputs(now)
        if self.maintenance.due(now):
            self._begin_maintenance(now)

    def _begin_maintenance(self, now: float) -> None:
        """Trim the journal and remove the engine's leftovers (off the loop)."""
        self.maintenance.begin(now)
        context = self.tools.context
        wall = self.tools.clock.now()
        busy = frozenset(entry.key for entry in self.tools.executor.all_in_flight())
        known = frozenset(session.key for session in self.sessions()) | busy

        def work() -> str:
            trimmed = context.journal.trim(wall, context.config.daemon.journal_retention)
            removed = context.runtime.cleanup(known)
            return f"{trimmed} journal row(s) trimmed; removed {', '.join(removed) or 'nothing'}"

        self.tools.background("maintenance", work, self._maintained)

    def _maintained(self, result: str | Exception) -> None:
        self.maintenance.finish(self.tools.clock.monotonic())
        if isinstance(result, Exception):
            log.error("maintenance failed: %s", result)
        else:
            log.info("maintenance: %s", result)

    def _begin_outputs(self, now: float) -> None:
        """The output service, removal notices, pruning and the output disk (off the loop)."""
        self.outputs.begin(now)
        context = self.tools.context
        wall = self.tools.clock.now()
        sessions = list(self.sessions())
        self.outputs_logins = self.outputs_logins | {session.user for session in sessions}
        notices = context.notices

        def work() -> str:
            return context.outputs.run(wall, sessions, notices.output_notice, notices.to_admin)

        self.tools.background("outputs", work, self._outputs_done)

    def _new_logins(self) -> bool:
        """Whether a session of a login the last outputs round did not see is there now."""
        return any(session.user not in self.outputs_logins for session in self.sessions())

    def _outputs_done(self, result: str | Exception) -> None:
        self.outputs.finish(self.tools.clock.monotonic())
        if isinstance(result, Exception):
            log.error("outputs round failed: %s", result)
        else:
            log.info("outputs: %s", result)
