"""The survey of the engine: which sessions it runs and which GPUs the host has.

A survey lists the engine's sessions off the loop; what it finds is planned
with at once (`on_seen`). Every change the daemon makes to the engine (an
action that ended) marks what was seen stale: a survey that began before it
is not planned with, since it may lack what the action made and the planner
would hand its GPUs and ports to another booking. An engine that does not
answer is surveyed again after a back-off that doubles up to
`[daemon] docker_retry_max`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from gpuresa import systemd
from gpuresa.daemon.periodic import Periodic
from gpuresa.daemon.tools import Tools
from gpuresa.model import Session
from gpuresa.sessions.errors import EngineTimeout, RuntimeUnavailable

log = logging.getLogger(__name__)

Seen = tuple[list[Session], tuple[int, ...]]


class Survey:
    """What the engine was last seen to hold, and when the next survey is due.

    `on_seen(sessions, gpus)`: called on the loop thread with each survey
    that is still current.
    """

    def __init__(self, tools: Tools, on_seen: Callable[[list[Session], tuple[int, ...]], None]):
        self.tools = tools
        self.on_seen = on_seen
        self.sessions: list[Session] = []
        self.gpus: tuple[int, ...] = ()
        # due again at once after a survey, later after a failed one (the back-off)
        self.job = Periodic("survey", lambda: 0.0)
        self.backoff = timedelta(seconds=1)
        # whether a round is wanted (a survey then begins as soon as it is due)
        self.wanted = True
        # when the engine was last surveyed, and whether nothing changed since
        self.seen_at = float("-inf")
        self.fresh = False
        # counts the changes the daemon made to the engine (see `changed`)
        self.generation = 0

    def want(self) -> None:
        """Plan again as soon as the engine has been surveyed."""
        self.wanted = True

    def changed(self) -> None:
        """Something of the engine changed: plan again with a fresh survey."""
        self.wanted = True
        self.fresh = False
        self.generation += 1

    def due(self, now: float) -> bool:
        """Whether a wanted survey may begin at monotonic `now` (pure)."""
        return self.wanted and self.job.due(now)

    def fresh_within(self, now: float, seconds: float) -> bool:
        """Whether the last survey is at most `seconds` old with nothing changed since."""
        return self.fresh and now - self.seen_at < seconds

    def begin(self) -> None:
        """Survey the engine off the loop; the result is planned with if still current."""
        self.job.begin(self.tools.clock.monotonic())
        self.wanted = False
        runtime = self.tools.context.runtime
        generation = self.generation
        self.tools.background(
            "survey",
            lambda: (runtime.list_sessions(), runtime.host_gpus()),
            lambda result: self.surveyed(result, generation),
        )

    def surveyed(self, result: Seen | Exception, generation: int) -> None:
        """A survey that began at `generation` returned `result` (on the loop thread)."""
        now = self.tools.clock.monotonic()
        # due again at once, unless an action met the engine down meanwhile (its back-off)
        self.job.finish(now, after=max(self.job.next_at - now, 0.0))
        if generation != self.generation:
            self.wanted = True  # an action ended meanwhile: look again
            return
        if isinstance(result, Exception):
            if not isinstance(result, (RuntimeUnavailable, EngineTimeout)):
                log.error("looking at the sessions failed: %s", result)
            self.engine_down(result)
            return
        self.backoff = timedelta(seconds=1)
        self.sessions, self.gpus = result
        self.seen_at, self.fresh = self.tools.clock.monotonic(), True
        self.on_seen(*result)

    def engine_down(self, error: Exception) -> None:
        """The engine did not answer: survey again after the back-off, which doubles."""
        delay = self.backoff
        self.tools.counters.count_error("engine")
        log.error("Docker engine unavailable (%s); retrying in %ss", error, delay.total_seconds())
        systemd.status(f"Docker unavailable, retrying in {int(delay.total_seconds())}s")
        self.backoff = min(delay * 2, self.tools.context.config.daemon.docker_retry_max)
        self.job.next_at = self.tools.clock.monotonic() + delay.total_seconds()
        self.wanted = True
