"""Rounds of the loop: plan with what is in flight, dispatch, and take what comes back.

A part of the loop that runs on the loop thread only. Each action's lane,
deadline and effects come from its row in `actions.KINDS`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from gpuresa.daemon.actions import Call, kind_of
from gpuresa.daemon.executor import KILL, LIFE_CYCLE
from gpuresa.daemon.images import Builds
from gpuresa.daemon.logins import LoginWatch
from gpuresa.daemon.memory import RETRY_DELAYS, Remembered
from gpuresa.daemon.observing import GpuWatch
from gpuresa.daemon.polling import Polling
from gpuresa.daemon.survey import Survey
from gpuresa.daemon.tools import Tools
from gpuresa.daemon.work import UNWINDING, Done, Started
from gpuresa.model import Session
from gpuresa.planning.actions import Action, Stop
from gpuresa.planning.planner import plan
from gpuresa.planning.wakeups import wakeups
from gpuresa.sessions.errors import ImageMissing, PortRefused, RuntimeUnavailable

log = logging.getLogger(__name__)

# A stop a restart interrupted is finished at most this many times before the admin is told.
MAX_FINISH_ATTEMPTS = 5
# A port the engine refused is skipped for this long, then tried again.
REFUSED_PORT_FOR = timedelta(hours=1)


class Rounds:
    """Planning, dispatching and the actions' outcomes, with the loop's memory.

    `on_start(session, public host)`: called when a session has started.
    `publish()`: a new picture for `/metrics` and the page, after each round.
    """

    def __init__(
        self,
        tools: Tools,
        survey: Survey,
        polling: Polling,
        watch: GpuWatch,
        publish: Callable[[], None],
        on_start: Callable[[Session, str], None] | None = None,
    ) -> None:
        self.tools = tools
        self.survey = survey
        self.polling = polling
        self.watch = watch
        self.publish = publish
        self.on_start = on_start
        self.remembered = Remembered.load(tools.context.journal)
        self.builds = Builds(tools, self.remembered, polling.reservation, survey.changed)
        # the first logins awaited where no-shows are released; a check plans again
        self.logins = LoginWatch(tools, self.remembered, survey.want)
        # the exact instants the planner wants a round at
        self.timers: list[datetime] = []

    # --- a round: plan and dispatch ---------------------------------------------------------

    def round(self, sessions: list[Session], gpus: tuple[int, ...]) -> None:
        """Plan with `sessions` and `gpus` as surveyed and what is in flight; dispatch."""
        context = self.tools.context
        now = self.tools.clock.now()
        config = context.config
        reservations = self.polling.reservations
        inventory = self.watch.inventory(gpus)
        self._finish_interrupted_stops(sessions, now)
        in_flight = self.tools.executor.in_flight()
        memory = self.remembered.memory(reservations, sessions, in_flight, now, context.journal)
        actions = self.watch.without_lost(
            plan(reservations, sessions, inventory, now, config, memory)
        )
        if actions:
            log.debug("round: %s", [action.describe() for action in actions])
        by_key = {session.key: session for session in sessions}
        stopping_gpus = {
            index
            for entry in in_flight.values()
            if isinstance(entry.payload, Stop)
            for index in by_key.get(entry.key, _NO_SESSION).gpu_indices
        }
        for action in actions:
            session = by_key.get(action.key)
            if isinstance(action, Stop) and session is not None:
                stopping_gpus.update(session.gpu_indices)
            self._dispatch(action, session, now, stopping_gpus)
        self._owed_start_notices(sessions, now)
        self.timers = wakeups(reservations, sessions, inventory, now, config, memory)
        self.logins.follow(reservations, sessions)
        self.publish()

    def _dispatch(
        self, action: Action, session: Session | None, now: datetime, stopping_gpus: set[int]
    ) -> None:
        key = action.key
        executor = self.tools.executor
        kind = kind_of(action)
        if kind is None:
            log.error("%s: no way to carry out %s", key, action.describe())
            return
        if executor.busy(key, kind.lane):
            return  # the same kind of action is still under way for this session
        if kind.lane == LIFE_CYCLE and executor.busy(key, KILL):
            return  # a forced kill of this session is under way: nothing new until it is done
        spec = getattr(action, "spec", None)
        if (
            kind.waits_for_gpus
            and spec is not None
            and stopping_gpus.intersection(spec.gpu_indices)
        ):
            # the GPUs' last session is still stopping: start once it is gone
            log.info("%s: waits for its GPUs' previous session to stop", key)
            return
        if kind.backs_off and now < self.remembered.retry_after.get(key, now):
            return  # a stop that failed is retried after its back-off, not every round
        context = self.tools.context
        reservation = self.polling.reservation(key)
        call = Call(context.work, session, reservation.user if reservation else None, now)
        kind.noted(action, self.remembered, context, now)
        log.info("%s", action.describe())
        payload: object = action if isinstance(action, Stop) else spec
        dispatched = self.tools.clock.monotonic()
        executor.submit(
            key,
            type(action).__name__.lower(),
            functools.partial(kind.effect, action, call),
            lambda outcome: self._done(action, session, outcome, dispatched),
            kind.deadline(action),
            payload=payload,
            lane=kind.lane,
        )

    # --- what came back ---------------------------------------------------------------------

    def _done(
        self, action: Action, session: Session | None, outcome: object, dispatched: float
    ) -> None:
        """An action finished (or failed): memory, journal, retries; then plan again.

        `dispatched`: when it was handed to the executor (the clock's monotonic time).
        """
        key = action.key
        context = self.tools.context
        counters = self.tools.counters
        now = self.tools.clock.now()
        remembered = self.remembered
        kind = kind_of(action)
        assert kind is not None  # only known kinds are dispatched
        self.survey.changed()
        if isinstance(outcome, (Started, Done)):
            if kind.latency is not None:
                counters.observe_latency(kind.latency, self.tools.clock.monotonic() - dispatched)
            kind.settled(key, remembered, context)
            context.journal.history.record_action(key, action.describe(), now, "ok")
            if isinstance(outcome, Started) and self.on_start is not None:
                self.on_start(outcome.session, context.public_host())
            return
        error = outcome if isinstance(outcome, Exception) else RuntimeError(repr(outcome))
        if isinstance(error, ImageMissing):
            self.builds.wait_for(key, error.template, error.cuda, now)
            return
        context.journal.history.record_action(key, action.describe(), now, "failed", str(error))
        counters.count_error(f"{type(action).__name__.lower()}-failed")
        if isinstance(error, RuntimeUnavailable):
            self.survey.engine_down(error)
            remembered.retry_after[key] = now + self.survey.backoff
            return
        if isinstance(error, PortRefused):
            log.warning("%s: ports %s are taken by another program; choosing others", key,
                        list(error.ports))  # fmt: skip
            for port in error.ports:
                remembered.refused_ports[port] = now + REFUSED_PORT_FOR
            return
        log.error("%s: %s failed: %s", key, type(action).__name__.lower(), error)
        if kind.on_failure == "kill" and isinstance(action, Stop):
            self._stop_failed(action, str(error), now)
        elif kind.on_failure == "back-off":
            attempts = remembered.back_off(key, now)
            context.journal.states.set(key, "failed", now, f"attempt {attempts}: {error}")
            spec = getattr(action, "spec", None)
            if attempts == 1 and spec is not None:
                context.notices.failure(key, spec.user, spec.email, str(error))

    def _stop_failed(self, action: Stop, error: str, now: datetime) -> None:
        """A stop that failed or overran: kill at once, tell the admin once, retry later."""
        key = action.key
        context = self.tools.context
        self.remembered.back_off(key, now)
        context.notices.to_admin(
            key,
            "stop-failed",
            f"session {key} did not stop cleanly",
            f"The stop of session {key} on {context.config.daemon.host} failed or "
            f"overran its deadline: {error}\n\nIts containers are being killed and removed; "
            "the stop is retried with a back-off until nothing of the session is left. "
            "`gpuresa status` and `gpuresa history` show where it stands.\n",
        )
        work = context.work
        self.tools.executor.submit(
            key,
            "kill",
            lambda: work.kill(key),
            lambda outcome: self._killed(key, outcome),
            60,
            lane=KILL,
        )

    def _killed(self, key: str, outcome: object) -> None:
        now = self.tools.clock.now()
        result = "ok" if isinstance(outcome, Done) else "failed"
        error = None if result == "ok" else str(outcome)
        self.tools.context.journal.history.record_action(
            key, "kill (stop escalated)", now, result, error
        )
        self.survey.changed()

    def overdue(self, key: str, what: str, payload: object) -> None:
        """An action overran its deadline: reported; a stop escalates to a kill."""
        now = self.tools.clock.now()
        log.error("%s: %s is overdue; it may be stuck in the engine", key, what)
        self.tools.counters.count_error("overdue")
        self.tools.context.journal.history.record_action(
            key, what, now, "failed", "overran its deadline"
        )
        if isinstance(payload, Stop):
            self._stop_failed(payload, "the stop overran its deadline", now)

    # --- finishing what a restart interrupted ------------------------------------------------

    def _finish_interrupted_stops(self, sessions: list[Session], now: datetime) -> None:
        """Finish the stops a restart (or a failure) cut short after the containers went.

        A stop that had told its user left a record (`stopping:<key>`): its
        output is handed over and the end notice sent. Every stop left its
        reason (`unwinding:<key>`): the network and files it left are removed.
        """
        present = {session.key for session in sessions}
        journal = self.tools.context.journal
        records = journal.facts.with_prefix("stopping:")
        unwinding = journal.facts.with_prefix(UNWINDING)
        work = self.tools.context.work
        jobs: dict[str, Callable[[], object]] = {
            key: functools.partial(work.finish_unwinding, key, reason, now)
            for key, reason in unwinding.items()
        }
        for key, record in records.items():
            jobs[key] = functools.partial(work.finish_interrupted_stop, key, record, now)
        for key, job in jobs.items():
            if key in present or self.tools.executor.busy(key):
                continue  # the planner stops it again, or it is being finished
            _, retry_after = self.remembered.finishing.get(key, (0, now))
            if now < retry_after:
                continue
            self.tools.executor.submit(
                key, "finish-stop", job, functools.partial(self._interrupted_stop_done, key), 600
            )

    def _interrupted_stop_done(self, key: str, outcome: object) -> None:
        finishing = self.remembered.finishing
        if not isinstance(outcome, Exception):
            finishing.pop(key, None)
            return
        now = self.tools.clock.now()
        attempts = finishing.get(key, (0, now))[0] + 1
        finishing[key] = (attempts, now + RETRY_DELAYS[min(attempts, len(RETRY_DELAYS)) - 1])
        log.error("%s: finishing an interrupted stop failed (%d): %s", key, attempts, outcome)
        if attempts >= MAX_FINISH_ATTEMPTS:
            # the containers are gone: what is left is the hand-over and the end notice
            finishing.pop(key, None)
            self.tools.context.journal.facts.delete(f"stopping:{key}")
            self.tools.context.journal.facts.delete(f"{UNWINDING}{key}")
            self.tools.context.notices.to_admin(
                key,
                "finish-stop-failed",
                f"the end of session {key} could not be finished",
                f"Session {key} was stopped, but handing its output over and telling its "
                f"user failed {attempts} times: {outcome}\n\nIts output folder is kept; "
                "gpuresa gives up on finishing it.\n",
            )

    def _owed_start_notices(self, sessions: list[Session], now: datetime) -> None:
        """Finish starts a restart interrupted: journal the running state, send the notice.

        The outbox sends a start notice once per session details, so asking
        again is harmless; `remembered.start_noticed` spares the journal the asking.
        """
        wanted = {reservation.key: reservation for reservation in self.polling.reservations}
        for session in sessions:
            reservation = wanted.get(session.key)
            if session.state != "running" or reservation is None:
                continue
            if self.tools.executor.busy(session.key):
                continue
            marker = (session.key, session.ssh_port, session.ftp_password)
            if marker in self.remembered.start_noticed:
                continue
            if self.tools.context.journal.states.get(session.key) in (
                None,
                "booked",
                "preparing",
                "failed",
            ):
                self.tools.context.journal.states.set(session.key, "running", now, "adopted")
            self.tools.context.notices.start(session, reservation.email)
            self.remembered.start_noticed.add(marker)


class _NoSession:
    gpu_indices: tuple[int, ...] = ()


_NO_SESSION = _NoSession()
