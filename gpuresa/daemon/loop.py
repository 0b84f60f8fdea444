"""The control loop: it only decides and dispatches, and never waits on anything outside.

One thread owns the daemon's state. Everything that can hang runs elsewhere
and reports back through `post`: the calendar poll and the observation of
Docker on background threads, the actions on the executor (one per session,
each with a deadline), image builds on a build thread, and e-mail in the
outbox. So a hung CalDAV server, a Docker call that never returns, an SMTP
relay that accepts and never answers, a build that takes an hour, or a user
who replaced every binary in their session delays nothing but itself.

A round: observe Docker (off the loop), then `plan()` (pure) with what is in
flight, then hand each action to the executor. Rounds follow each poll, each
finished action, each exact-time wakeup and each finished build.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

from gpuresa import systemd
from gpuresa.daemon import vanish
from gpuresa.daemon.executor import Executor
from gpuresa.daemon.memory import Remembered
from gpuresa.daemon.observing import Observing
from gpuresa.daemon.rounds import Rounds
from gpuresa.daemon.sampling import Sampler
from gpuresa.daemon.state import Context
from gpuresa.model import Rejection, Reservation, Session
from gpuresa.reservations.calendars import CalendarReport
from gpuresa.runtime.errors import (
    EngineTimeout,
    RuntimeUnavailable,
)

log = logging.getLogger(__name__)

Result = TypeVar("Result")

# The loop wakes at least this often (deadlines, the heartbeat).
BEAT = 1.0
# Docker is looked at this long before an exact-time wakeup, so the round at
# that instant plans at once with what was seen (nothing changed since: every
# change the daemon makes marks the view stale).
LOOK_AHEAD = 1.0
# A view of Docker at most this old, with nothing changed since, is planned with.
FRESH_FOR = 5.0
# A calendar poll that takes longer (or 5 poll intervals) is abandoned.
POLL_DEADLINE = 300.0
# How often the journal is trimmed and Docker's leftovers collected.
MAINTENANCE_EVERY = timedelta(hours=1)
# how often the output service is checked, removal notices sent and outputs pruned
OUTPUTS_EVERY = timedelta(minutes=10)


class Loop(Rounds, Observing):
    """The decision loop of one daemon; `run()` returns once `stopping` is set.

    `sampler`: the GPU sampler (None: no GPU telemetry at all).
    """

    def __init__(
        self,
        context: Context,
        *,
        on_start: Callable[[Session, str], None] | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        self.context = context
        self.on_start = on_start
        self.stopping = threading.Event()
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.executor = Executor(self.post)
        self.remembered = Remembered.load(context.journal)
        self.reservations: list[Reservation] = []
        self._polled: list[Reservation] = []
        self.hold: vanish.Hold | None = None
        self.sessions: list[Session] = []
        self.gpus: tuple[int, ...] = ()
        # when Docker was last looked at, and whether nothing changed since
        self._observed_at = float("-inf")
        self._fresh = False
        # counts the changes the daemon made to Docker (see `Rounds._changed`)
        self._generation = 0
        self.timers: list[datetime] = []
        self._next_poll = 0.0
        self._polling = False
        self._poll_number = 0
        self._poll_deadline = 0.0
        self._dirty = True
        self._observing = False
        self._observe_after = 0.0
        self.docker_backoff = timedelta(seconds=1)
        self.builds: set[tuple[str | None, str | None]] = set()
        self.image_waiting: dict[str, tuple[str | None, str | None]] = {}
        self._next_maintenance = time.monotonic() + 60
        self._maintaining = False
        # the output service is wanted soon after a start: sessions may end any minute
        self._next_outputs = time.monotonic() + 2
        self._outputs_running = False
        # monotonic time of the loop's last turn, for the watchdog
        self.heartbeat = time.monotonic()
        self._init_observing(sampler)

    # --- the loop itself ---------------------------------------------------------------

    def post(self, job: Callable[[], None]) -> None:
        """Run `job` on the loop thread soon (from any thread)."""
        self._queue.put(job)

    def wake(self) -> None:
        self.post(lambda: None)

    def request_round(self) -> None:
        """Plan again as soon as Docker has been looked at (from the loop thread)."""
        self._dirty = True

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                job: Callable[[], None] | None = self._queue.get(timeout=self._wait())
            except queue.Empty:
                job = None
            while job is not None and not self.stopping.is_set():
                self._safely(job)
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    job = None
            if not self.stopping.is_set():
                self._safely(self._turn)
            self.heartbeat = time.monotonic()

    def _safely(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # a bug in one step must not stop the loop
            log.exception("unexpected error in the daemon's loop; going on")

    def _wait(self) -> float:
        """Seconds until the next thing the loop must do by itself (at most `BEAT`)."""
        wait = min(BEAT, self._next_poll - time.monotonic())
        if self.timers:
            until = (self.timers[0] - self.context.clock()).total_seconds()
            wait = min(wait, until - LOOK_AHEAD if until > LOOK_AHEAD else until)
        return max(wait, 0.01)

    def _turn(self) -> None:
        """What is due: a poll, exact-time wakeups, overdue actions, a round."""
        monotonic = time.monotonic()
        if self._polling and monotonic >= self._poll_deadline:
            # a server that trickles bytes keeps each read alive: the poll as a whole has a
            # deadline, and a late answer is ignored (`_poll_returned`)
            log.error("the calendar poll did not finish in time; abandoned, polling again")
            self._polling = False
        if not self._polling and monotonic >= self._next_poll:
            self._start_poll()
        now = self.context.clock()
        if self.timers and self.timers[0] <= now:
            self.timers = [instant for instant in self.timers if instant > now]
            if self._fresh and monotonic - self._observed_at < FRESH_FOR:
                self._round(self.sessions, self.gpus)
            elif not self._observing:
                self._dirty = True
        elif (
            self.timers
            and not self._observing
            and (self.timers[0] - now).total_seconds() <= LOOK_AHEAD
            and monotonic - self._observed_at > LOOK_AHEAD
        ):
            self._start_observe()
        for entry in self.executor.overdue():
            self._overdue(entry.key, entry.what, entry.payload)
        if not self._outputs_running and monotonic >= self._next_outputs:
            self._start_outputs()
        if not self._maintaining and monotonic >= self._next_maintenance:
            self._start_maintenance()
        self._sample_if_due(monotonic)
        if self._dirty and not self._observing and monotonic >= self._observe_after:
            self._start_observe()

    def _background(
        self, name: str, work: Callable[[], Result], done: Callable[[Result | Exception], None]
    ) -> None:
        """Run `work` on a thread of its own and `done(result or error)` on the loop."""

        def run() -> None:
            try:
                result: Result | Exception = work()
            except Exception as error:
                result = error
            self.post(lambda: done(result))

        threading.Thread(target=run, name=f"gpuresa-{name}", daemon=True).start()

    # --- maintenance ------------------------------------------------------------------------

    def _start_maintenance(self) -> None:
        """Trim the journal and remove Docker leftovers (off the loop), once an hour."""
        self._maintaining = True
        context = self.context
        now = context.clock()
        busy = frozenset(entry.key for entry in self.executor.all_in_flight())
        known = frozenset(session.key for session in self.sessions) | busy

        def work() -> str:
            trimmed = context.journal.trim(now, context.config.daemon.journal_retention)
            removed = context.runtime.collect_garbage(set(known))
            return f"{trimmed} journal row(s) trimmed; removed {', '.join(removed) or 'nothing'}"

        self._background("maintenance", work, self._maintained)

    def _maintained(self, result: str | Exception) -> None:
        self._maintaining = False
        self._next_maintenance = time.monotonic() + MAINTENANCE_EVERY.total_seconds()
        if isinstance(result, Exception):
            log.error("maintenance failed: %s", result)
        else:
            log.info("maintenance: %s", result)

    # --- outputs ------------------------------------------------------------------------------

    def _start_outputs(self) -> None:
        """The output service, removal notices, pruning and the output disk (off the loop)."""
        self._outputs_running = True
        context = self.context
        now = context.clock()
        sessions = list(self.sessions)
        notices = context.notices

        def work() -> str:
            return context.outputs.run(now, sessions, notices.output_notice, notices.to_admin)

        self._background("outputs", work, self._outputs_done)

    def _outputs_done(self, result: str | Exception) -> None:
        self._outputs_running = False
        self._next_outputs = time.monotonic() + OUTPUTS_EVERY.total_seconds()
        if isinstance(result, Exception):
            log.error("outputs round failed: %s", result)
        else:
            log.info("outputs: %s", result)

    # --- polling the calendars -------------------------------------------------------------

    def _start_poll(self) -> None:
        self._polling = True
        self._poll_number += 1
        number = self._poll_number
        self._poll_deadline = time.monotonic() + max(
            POLL_DEADLINE, 5 * self.context.config.daemon.poll_interval.total_seconds()
        )
        context = self.context
        now = context.clock()
        # what each prepared or running session was given: its labels' times
        live = [item for item in self.sessions if item.state in ("created", "running")]
        holding = {session.key: (session.start, session.end) for session in live}
        holding_gpus = {session.key: len(session.gpus) for session in live}
        self._background(
            "poll",
            lambda: context.poll(now, holding, holding_gpus),
            lambda result: self._poll_returned(result, number),
        )

    def _poll_returned(
        self, result: tuple[CalendarReport, list[Rejection]] | Exception, number: int
    ) -> None:
        if number != self._poll_number:
            log.warning("a calendar poll abandoned for its slowness finished after all; ignored")
            return
        self._polled_done(result)

    def _polled_done(self, result: tuple[CalendarReport, list[Rejection]] | Exception) -> None:
        self._polling = False
        self._next_poll = (
            time.monotonic() + self.context.config.daemon.poll_interval.total_seconds()
        )
        if isinstance(result, Exception):
            log.error(
                "calendar poll failed unexpectedly; keeping the last reservations: %s", result
            )
            self.counters.count_error("poll")
            return
        report, new_rejections = result
        self._polled_report(report)
        host = self.context.config.daemon.host
        mine = [item for item in report.reservations.reservations if item.host == host]
        now = self.context.clock()
        with_session = {session.key for session in self.sessions}
        screened = vanish.screen(
            self._polled, mine, with_session, self.hold, now,
            self.context.config.daemon.vanish_confirm,
        )  # fmt: skip
        if screened.began and screened.hold is not None:
            self._vanish_began(screened.hold, len(mine))
        if screened.confirmed:
            log.warning("bookings missing for %s: the calendar is believed now", host)
        self._polled = mine
        self.hold = screened.hold
        self.reservations = list(screened.reservations)
        for rejection in new_rejections:
            self.context.reject(rejection)
        stale = [
            f"{name} ({freshness.last_error})"
            for name, freshness in report.freshness.items()
            if freshness.last_error
        ]
        if stale:
            self.counters.count_error("calendar")
            systemd.status(f"calendar unreachable, using the last snapshot: {', '.join(stale)}")
        else:
            systemd.status(f"{len(self.reservations)} reservation(s) for {host}")
        self._dirty = True

    def _vanish_began(self, hold: vanish.Hold, remaining: int) -> None:
        keys = ", ".join(sorted(hold.keys))
        confirm = self.context.config.daemon.vanish_confirm
        self.context.notices.to_admin(
            f"vanish:{self.context.config.daemon.host}",
            f"vanish-{hold.since.isoformat()}",
            f"{len(hold.kept)} running bookings vanished from the calendar",
            f"The calendar poll at {hold.since.isoformat()} no longer lists {len(hold.kept)} "
            f"bookings that have a session on {self.context.config.daemon.host} ({keys}); "
            f"it lists {remaining} for this host.\n\nThis looks like a calendar problem "
            "(a server migration, a wrong URL, an emptied collection), so those sessions go "
            f"on as booked. If the bookings are still missing after {confirm}, the calendar "
            "is believed and they are stopped as cancelled.\n",
        )

    # --- observing Docker ------------------------------------------------------------------

    def _start_observe(self) -> None:
        self._observing = True
        self._dirty = False
        runtime = self.context.runtime
        generation = self._generation
        self._background(
            "observe",
            lambda: (runtime.list_sessions(), runtime.host_gpus()),
            lambda result: self._observed(result, generation),
        )

    def _observed(
        self, result: tuple[list[Session], tuple[int, ...]] | Exception, generation: int
    ) -> None:
        self._observing = False
        if generation != self._generation:
            self._dirty = True  # an action ended meanwhile: look again
            return
        if isinstance(result, (RuntimeUnavailable, EngineTimeout)):
            self._engine_down(result)
            return
        if isinstance(result, Exception):
            log.error("looking at the sessions failed: %s", result)
            self._engine_down(result)
            return
        self.docker_backoff = timedelta(seconds=1)
        sessions, gpus = result
        self.sessions, self.gpus = sessions, gpus
        self._observed_at, self._fresh = time.monotonic(), True
        self._round(sessions, gpus)

    def _engine_down(self, error: Exception) -> None:
        delay = self.docker_backoff
        self.counters.count_error("engine")
        log.error("Docker engine unavailable (%s); retrying in %ss", error, delay.total_seconds())
        systemd.status(f"Docker unavailable, retrying in {int(delay.total_seconds())}s")
        self.docker_backoff = min(delay * 2, self.context.config.daemon.docker_retry_max)
        self._observe_after = time.monotonic() + delay.total_seconds()
        self._dirty = True
