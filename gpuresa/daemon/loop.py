"""The control loop: it only decides and dispatches, and never waits on anything outside.

One thread owns the daemon's state. Everything that can hang runs elsewhere
and reports back through `post`: the calendar poll and the survey of the
engine on background threads, the actions on the executor (one per session,
each with a deadline), image builds on a build thread, and e-mail in the
outbox. So a hung CalDAV server, an engine call that never returns, an SMTP
relay that accepts and never answers, a build that takes an hour, or a user
who replaced every binary in their session delays nothing but itself.

A round: survey the engine (off the loop), then `plan()` (pure) with what is
in flight, then hand each action to the executor. Rounds follow each poll,
each finished action, each exact-time wakeup and each finished build.

The loop is composed of parts that each own their state: `Survey` (the
engine), `Polling` (the calendars), `Rounds` (planning and the actions),
`GpuWatch` (GPU telemetry), `Housekeeping` (maintenance, outputs) and
`Publisher` (what `/metrics` and the page show). It reads one clock.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from gpuresa.daemon.clock import Clock, SystemClock
from gpuresa.daemon.executor import Executor
from gpuresa.daemon.housekeeping import Housekeeping
from gpuresa.daemon.memory import Remembered
from gpuresa.daemon.observing import GpuWatch
from gpuresa.daemon.polling import Polling
from gpuresa.daemon.publishing import Publisher
from gpuresa.daemon.rounds import Rounds
from gpuresa.daemon.sampling import Sampler
from gpuresa.daemon.state import Context
from gpuresa.daemon.survey import Survey
from gpuresa.daemon.tools import Tools
from gpuresa.model import Session
from gpuresa.observe.state import Counters, Published
from gpuresa.reservations.sources.watching import Watches

log = logging.getLogger(__name__)

# The loop wakes at least this often (deadlines, the heartbeat).
BEAT = 1.0
# The engine is surveyed this long before an exact-time wakeup, so the round at
# that instant plans at once with what was seen (nothing changed since: every
# change the daemon makes marks the survey stale).
LOOK_AHEAD = 1.0
# A survey at most this old, with nothing changed since, is planned with.
FRESH_FOR = 5.0


class Loop:
    """The decision loop of one daemon; `run()` returns once `stopping` is set.

    `sampler`: the GPU sampler (None: no GPU telemetry at all). `clock`: the
    one clock the loop and its parts read (default: the host's, with the
    context's wall clock).
    """

    def __init__(
        self,
        context: Context,
        *,
        on_start: Callable[[Session, str], None] | None = None,
        sampler: Sampler | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or SystemClock(context.clock)
        self.stopping = threading.Event()
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.executor = Executor(self.post, self.clock.monotonic)
        self.tools = Tools(context, self.clock, self.executor, Counters(), self.post)
        self.survey = Survey(self.tools, self._seen)
        self.polling = Polling(self.tools, self._sessions, self.survey.want)
        self.publisher = Publisher(self.tools, self.survey, self.polling, lambda: self.watch)
        self.watch = GpuWatch(
            self.tools, sampler, self._sessions, self.survey.changed, self.publisher.publish
        )
        self.rounds = Rounds(
            self.tools, self.survey, self.polling, self.watch, self.publisher.publish, on_start
        )
        self.housekeeping = Housekeeping(self.tools, self._sessions)
        # monotonic time of the loop's last turn, for the watchdog
        self.heartbeat = self.clock.monotonic()
        # local calendars watched while the loop runs: a change is polled at once
        self.watches: Watches | None = None

    # --- what the daemon reads of the loop -------------------------------------------------

    @property
    def context(self) -> Context:
        return self.tools.context

    @context.setter
    def context(self, context: Context) -> None:
        """A reload: every part acts with the new context from now on."""
        self.tools.context = context
        if self.watches is not None:
            self.watches.close()
            self.watches = self._watch()

    @property
    def published(self) -> Published:
        return self.publisher.published

    @property
    def sampling(self) -> bool:
        """Whether a GPU sample is under way (its thread uses the sampler)."""
        return self.watch.sampling

    @property
    def remembered(self) -> Remembered:
        return self.rounds.remembered

    @property
    def counters(self) -> Counters:
        return self.tools.counters

    def _sessions(self) -> list[Session]:
        return self.survey.sessions

    def _seen(self, sessions: list[Session], gpus: tuple[int, ...]) -> None:
        self.rounds.round(sessions, gpus)

    # --- the loop itself ---------------------------------------------------------------

    def post(self, job: Callable[[], None]) -> None:
        """Run `job` on the loop thread soon (from any thread)."""
        self._queue.put(job)

    def wake(self) -> None:
        self.post(lambda: None)

    def request_round(self) -> None:
        """Plan again as soon as the engine has been surveyed (from the loop thread)."""
        self.survey.want()

    def _watch(self) -> Watches:
        sources = self.context.calendars.sources.values()
        return Watches(sources, lambda: self.post(self.polling.soon))

    def run(self) -> None:
        self.watches = self._watch()
        try:
            self._run()
        finally:
            self.watches.close()
            self.watches = None

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                job: Callable[[], None] | None = self._queue.get(timeout=self._wait())
            except queue.Empty:
                job = None
            while job is not None and not self.stopping.is_set():
                self._safely(job)
                job = self.next_job()
            if not self.stopping.is_set():
                self._safely(self.turn)
            self.heartbeat = self.clock.monotonic()

    def next_job(self) -> Callable[[], None] | None:
        """The next job posted to the loop, if one is waiting."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def _safely(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # a bug in one step must not stop the loop
            log.exception("unexpected error in the daemon's loop; going on")

    def _wait(self) -> float:
        """Seconds until the next thing the loop must do by itself (at most `BEAT`)."""
        wait = min(BEAT, self.polling.job.next_at - self.clock.monotonic())
        timers = self.rounds.timers
        if timers:
            until = (timers[0] - self.clock.now()).total_seconds()
            wait = min(wait, until - LOOK_AHEAD if until > LOOK_AHEAD else until)
        return max(wait, 0.01)

    def turn(self) -> None:
        """What is due: a poll, exact-time wakeups, overdue actions, periodic jobs, a round."""
        monotonic = self.clock.monotonic()
        survey = self.survey
        self.polling.tick(monotonic)
        now = self.clock.now()
        timers = self.rounds.timers
        if timers and timers[0] <= now:
            self.rounds.timers = [instant for instant in timers if instant > now]
            if survey.fresh_within(monotonic, FRESH_FOR):
                self.rounds.round(survey.sessions, survey.gpus)
            elif not survey.job.running:
                survey.want()
        elif (
            timers
            and not survey.job.running
            and (timers[0] - now).total_seconds() <= LOOK_AHEAD
            and monotonic - survey.seen_at > LOOK_AHEAD
        ):
            survey.begin()
        for entry in self.executor.overdue():
            self.rounds.overdue(entry.key, entry.what, entry.payload)
        self.housekeeping.tick(monotonic)
        self.rounds.logins.tick(monotonic)
        self.watch.tick(monotonic)
        if survey.due(monotonic):
            survey.begin()
