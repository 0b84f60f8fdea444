"""Rounds of the loop: plan with what is in flight, dispatch, and take what comes back.

A part of `loop.Loop`, kept apart for size: it runs on the loop thread only.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from gpuresa.daemon.executor import KILL, LIFE_CYCLE, NOTICE, Executor
from gpuresa.daemon.memory import RETRY_DELAYS, Remembered
from gpuresa.daemon.state import Context
from gpuresa.daemon.work import Done, Started, deadline_of
from gpuresa.model import Reservation, Session
from gpuresa.observe.state import Counters
from gpuresa.planning.planner import (
    Action,
    Extend,
    Fail,
    Inventory,
    NotifyCancel,
    NotifyChange,
    Prepare,
    Recreate,
    Start,
    Stop,
    Warn,
    plan,
    wakeups,
)
from gpuresa.runtime.errors import ImageMissing, PortRefused, RuntimeUnavailable

log = logging.getLogger(__name__)

# How often a session waiting for its image's build looks again (a finished
# build also wakes the loop at once).
IMAGE_WAIT = timedelta(seconds=10)
# A stop a restart interrupted is finished at most this many times before the admin is told.
MAX_FINISH_ATTEMPTS = 5
# A port the engine refused is skipped for this long, then tried again.
REFUSED_PORT_FOR = timedelta(hours=1)


class Rounds:
    """Planning, dispatching and the actions' outcomes; mixed into `Loop`."""

    context: Context
    executor: Executor
    remembered: Remembered
    reservations: list[Reservation]
    timers: list[datetime]
    builds: set[tuple[str | None, str | None]]
    image_waiting: dict[str, tuple[str | None, str | None]]
    on_start: Callable[[Session, str], None] | None
    docker_backoff: timedelta
    _dirty: bool

    _fresh: bool
    _generation: int

    counters: Counters

    if TYPE_CHECKING:  # `Observing` has them

        def _publish(self) -> None: ...

        def _inventory(self, gpus: tuple[int, ...]) -> Inventory: ...

        def _without_lost(self, actions: list[Action]) -> list[Action]: ...

    def _changed(self) -> None:
        """Something of Docker changed (an action ended): plan again with a fresh look.

        A look at Docker that began before this change is not planned with:
        it may lack what the action made, and the planner would hand its GPUs
        and ports to another booking.
        """
        self._dirty = True
        self._fresh = False
        self._generation += 1

    def _engine_down(self, error: Exception) -> None:
        raise NotImplementedError

    def _background(
        self, name: str, work: Callable[[], object], done: Callable[[object], None]
    ) -> None:
        raise NotImplementedError

    # --- a round: plan and dispatch ---------------------------------------------------------

    def _round(self, sessions: list[Session], gpus: tuple[int, ...]) -> None:
        context = self.context
        now = context.clock()
        config = context.config
        inventory = self._inventory(gpus)
        self._finish_interrupted_stops(sessions, now)
        in_flight = self.executor.in_flight()
        memory = self.remembered.memory(
            self.reservations, sessions, in_flight, now, context.journal
        )
        actions = self._without_lost(
            plan(self.reservations, sessions, inventory, now, config, memory)
        )
        if actions:
            log.debug("round: %s", [action.describe() for action in actions])
        by_key = {session.key: session for session in sessions}
        stopping_gpus = {
            index
            for entry in in_flight.values()
            if isinstance(entry.payload, Stop)
            for index in by_key.get(entry.key, _NO_SESSION).gpus
        }
        for action in actions:
            session = by_key.get(action.key)
            if isinstance(action, Stop) and session is not None:
                stopping_gpus.update(session.gpus)
            self._dispatch(action, session, now, stopping_gpus)
        self._owed_start_notices(sessions, now)
        self.timers = wakeups(self.reservations, sessions, inventory, now, config, memory)
        self._publish()

    def _dispatch(
        self, action: Action, session: Session | None, now: datetime, stopping_gpus: set[int]
    ) -> None:
        key = action.key
        work = self.context.work
        remembered = self.remembered
        lane = LIFE_CYCLE if isinstance(action, (Stop, Start, Recreate, Prepare)) else NOTICE
        if self.executor.busy(key, lane):
            return  # the same kind of action is still under way for this session
        if lane == LIFE_CYCLE and self.executor.busy(key, KILL):
            return  # a forced kill of this session is under way: nothing new until it is done
        spec = getattr(action, "spec", None)
        stopping_first = spec is not None and stopping_gpus.intersection(spec.gpus)
        if isinstance(action, (Start, Recreate)) and stopping_first:
            # the GPUs' last session is still stopping: start once it is gone
            log.info("%s: waits for its GPUs' previous session to stop", key)
            return
        if isinstance(action, Stop) and now < remembered.retry_after.get(key, now):
            return  # a stop that failed is retried after its back-off, not every round
        job: Callable[[], object]
        if isinstance(action, Stop):
            reservation = next((item for item in self.reservations if item.key == key), None)
            new_user = reservation.user if reservation is not None else None
            job = lambda: work.stop(action, session, new_user, now)  # noqa: E731
        elif isinstance(action, (Start, Recreate)):
            job = lambda: work.start(action, session, now)  # noqa: E731
        elif isinstance(action, Prepare):
            job = lambda: work.prepare(action, now)  # noqa: E731
        elif isinstance(action, Extend):
            remembered.extended(key, action.end, now, self.context.config, self.context.journal)
            job = lambda: work.extend(action)  # noqa: E731
        elif isinstance(action, Warn):
            remembered.warned(key, action.before, self.context.config, self.context.journal, now)
            job = lambda: work.warn(action, session, now)  # noqa: E731
        elif isinstance(action, NotifyCancel):
            remembered.cancel_noticed(key, self.context.journal, now)
            job = lambda: work.notify_cancel(action, session, now)  # noqa: E731
        elif isinstance(action, NotifyChange):
            remembered.changes_notified.add((key, action.change))
            job = lambda: work.notify_change(action)  # noqa: E731
        elif isinstance(action, Fail):
            remembered.back_off(key, now)
            job = lambda: work.fail(action, now)  # noqa: E731
        else:
            log.error("%s: no way to carry out %s", key, action.describe())
            return
        log.info("%s", action.describe())
        payload: object = action if isinstance(action, Stop) else spec
        dispatched = time.monotonic()
        self.executor.submit(
            key,
            type(action).__name__.lower(),
            job,
            lambda outcome: self._done(action, session, outcome, dispatched),
            deadline_of(action),
            payload=payload,
            lane=lane,
        )

    # --- what came back ---------------------------------------------------------------------

    def _done(
        self, action: Action, session: Session | None, outcome: object, dispatched: float
    ) -> None:
        """An action finished (or failed): memory, journal, retries; then plan again.

        `dispatched`: when it was handed to the executor (`time.monotonic()`).
        """
        key = action.key
        context = self.context
        now = context.clock()
        remembered = self.remembered
        self._changed()
        if isinstance(outcome, Started):
            self.counters.observe_latency("start", time.monotonic() - dispatched)
            remembered.started(key)
            context.journal.record_action(key, action.describe(), now, "ok")
            if self.on_start is not None:
                self.on_start(outcome.session, context.public_host())
            return
        if isinstance(outcome, Done):
            if isinstance(action, Stop):
                self.counters.observe_latency("stop", time.monotonic() - dispatched)
                remembered.stopped(key, context.journal)
            context.journal.record_action(key, action.describe(), now, "ok")
            return
        error = outcome if isinstance(outcome, Exception) else RuntimeError(repr(outcome))
        if isinstance(error, ImageMissing):
            self._wait_for_image(key, error.template, error.cuda, now)
            return
        context.journal.record_action(key, action.describe(), now, "failed", str(error))
        self.counters.count_error(f"{type(action).__name__.lower()}-failed")
        if isinstance(error, RuntimeUnavailable):
            self._engine_down(error)
            remembered.retry_after[key] = now + self.docker_backoff
            return
        if isinstance(error, PortRefused):
            log.warning("%s: ports %s are taken by another program; choosing others", key,
                        list(error.ports))  # fmt: skip
            for port in error.ports:
                remembered.refused_ports[port] = now + REFUSED_PORT_FOR
            return
        log.error("%s: %s failed: %s", key, type(action).__name__.lower(), error)
        if isinstance(action, Stop):
            self._stop_failed(action, str(error), now)
        elif isinstance(action, (Start, Recreate, Prepare)):
            attempts = remembered.back_off(key, now)
            context.journal.set_state(key, "failed", now, f"attempt {attempts}: {error}")
            if attempts == 1 and action.spec is not None:
                context.notices.failure(key, action.spec.user, action.spec.email, str(error))

    def _stop_failed(self, action: Stop, error: str, now: datetime) -> None:
        """A stop that failed or overran: kill at once, tell the admin once, retry later."""
        key = action.key
        self.remembered.back_off(key, now)
        self.context.notices.to_admin(
            key,
            "stop-failed",
            f"session {key} did not stop cleanly",
            f"The stop of session {key} on {self.context.config.daemon.host} failed or "
            f"overran its deadline: {error}\n\nIts containers are being killed and removed; "
            "the stop is retried with a back-off until nothing of the session is left. "
            "`gpuresa status` and `gpuresa history` show where it stands.\n",
        )
        work = self.context.work
        self.executor.submit(
            key,
            "kill",
            lambda: work.kill(key),
            lambda outcome: self._killed(key, outcome),
            60,
            lane=KILL,
        )

    def _killed(self, key: str, outcome: object) -> None:
        now = self.context.clock()
        result = "ok" if isinstance(outcome, Done) else "failed"
        error = None if result == "ok" else str(outcome)
        self.context.journal.record_action(key, "kill (stop escalated)", now, result, error)
        self._changed()

    def _overdue(self, key: str, what: str, payload: object) -> None:
        now = self.context.clock()
        log.error("%s: %s is overdue; it may be stuck in the engine", key, what)
        self.counters.count_error("overdue")
        self.context.journal.record_action(key, what, now, "failed", "overran its deadline")
        if isinstance(payload, Stop):
            self._stop_failed(payload, "the stop overran its deadline", now)

    # --- images -----------------------------------------------------------------------------

    def _wait_for_image(
        self, key: str, template: str | None, cuda: str | None, now: datetime
    ) -> None:
        self.remembered.retry_after[key] = now + IMAGE_WAIT
        wanted = (template, cuda)
        self.image_waiting[key] = wanted
        if wanted in self.builds:
            return
        self.builds.add(wanted)
        what = f"{template} (CUDA {cuda or 'default'})" if template else "the FTP sidecar"
        log.info("%s: building the image of %s in the background", key, what)
        work = self.context.work
        self._background(
            "build", lambda: work.build(template, cuda), lambda result: self._built(wanted, result)
        )

    def _built(self, wanted: tuple[str | None, str | None], result: object) -> None:
        """A build finished: the sessions that waited for it go on at once (or fail)."""
        self.builds.discard(wanted)
        if isinstance(result, Exception):
            self.counters.count_error("build")
        now = self.context.clock()
        waiting = [key for key, image in self.image_waiting.items() if image == wanted]
        for key in waiting:
            del self.image_waiting[key]
            self.remembered.retry_after.pop(key, None)
            if isinstance(result, Exception):
                attempts = self.remembered.back_off(key, now)
                reason = f"the image could not be built: {result}"
                self.context.journal.set_state(key, "failed", now, f"attempt {attempts}: {reason}")
                reservation = next((item for item in self.reservations if item.key == key), None)
                if attempts == 1 and reservation is not None:
                    self.context.notices.failure(key, reservation.user, reservation.email, reason)
        self._changed()

    # --- finishing what a restart interrupted ------------------------------------------------

    def _finish_interrupted_stops(self, sessions: list[Session], now: datetime) -> None:
        present = {session.key for session in sessions}
        records = self.context.journal.meta_with_prefix("stopping:")
        work = self.context.work
        for key, record in records.items():
            if key in present or self.executor.busy(key):
                continue  # the planner stops it again, or it is being finished
            _, retry_after = self.remembered.finishing.get(key, (0, now))
            if now < retry_after:
                continue
            self.executor.submit(
                key,
                "finish-stop",
                functools.partial(work.finish_interrupted_stop, key, record, now),
                functools.partial(self._interrupted_stop_done, key),
                600,
            )

    def _interrupted_stop_done(self, key: str, outcome: object) -> None:
        finishing = self.remembered.finishing
        if not isinstance(outcome, Exception):
            finishing.pop(key, None)
            return
        now = self.context.clock()
        attempts = finishing.get(key, (0, now))[0] + 1
        finishing[key] = (attempts, now + RETRY_DELAYS[min(attempts, len(RETRY_DELAYS)) - 1])
        log.error("%s: finishing an interrupted stop failed (%d): %s", key, attempts, outcome)
        if attempts >= MAX_FINISH_ATTEMPTS:
            # the containers are gone: what is left is the hand-over and the end notice
            finishing.pop(key, None)
            self.context.journal.delete_meta(f"stopping:{key}")
            self.context.notices.to_admin(
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
        wanted = {reservation.key: reservation for reservation in self.reservations}
        for session in sessions:
            reservation = wanted.get(session.key)
            if session.state != "running" or reservation is None:
                continue
            if self.executor.busy(session.key):
                continue
            marker = (session.key, session.ssh_port, session.ftp_password)
            if marker in self.remembered.start_noticed:
                continue
            if self.context.journal.state(session.key) in (None, "booked", "preparing", "failed"):
                self.context.journal.set_state(session.key, "running", now, "adopted")
            self.context.notices.start(session, reservation.email)
            self.remembered.start_noticed.add(marker)


class _NoSession:
    gpus: tuple[int, ...] = ()


_NO_SESSION = _NoSession()
