"""The calendar poll, every `[daemon] poll_interval` and at once when a watched file changes.

The poll reads the calendars and journals what they say on a thread of its
own; its result is taken in on the loop thread: the bookings of this host,
screened for a mass vanishing (`vanish`), and the rejections, whose users are
told. A server that trickles bytes keeps each read alive, so the poll as a
whole has a deadline; a late answer is ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuresa import systemd
from gpuresa.daemon import vanish
from gpuresa.daemon.periodic import Periodic
from gpuresa.daemon.tools import Tools
from gpuresa.model import Rejection, Reservation, Session
from gpuresa.reservations.calendars import CalendarReport

log = logging.getLogger(__name__)

# A calendar poll that takes longer (or 5 poll intervals) is abandoned.
POLL_DEADLINE = 300.0

Polled = tuple[CalendarReport, list[Rejection]]


class Polling:
    """The bookings the calendars last gave, and the poll job.

    `sessions()`: the sessions last seen (those with a session keep their
    slot). `on_polled()`: called after each poll taken in (a round is wanted).
    """

    def __init__(
        self,
        tools: Tools,
        sessions: Callable[[], list[Session]],
        on_polled: Callable[[], None],
    ) -> None:
        self.tools = tools
        self.sessions = sessions
        self.on_polled = on_polled
        self.job = Periodic(
            "poll", lambda: tools.context.config.daemon.poll_interval.total_seconds()
        )
        # what the planner plans with: the bookings after the vanish screen
        self.reservations: list[Reservation] = []
        # this host's bookings as the last poll gave them
        self.polled: list[Reservation] = []
        # a calendar changed while a poll was under way: poll again once it is back
        self.again = False
        self.hold: vanish.Hold | None = None
        self.report: CalendarReport | None = None

    def deadline(self) -> float:
        return max(
            POLL_DEADLINE, 5 * self.tools.context.config.daemon.poll_interval.total_seconds()
        )

    def tick(self, now: float) -> None:
        """At monotonic `now`: abandon a poll past its deadline, begin one that is due."""
        if self.job.overran(now, self.deadline()):
            log.error("the calendar poll did not finish in time; abandoned, polling again")
            self.job.abandon()
        if self.job.due(now):
            self.begin(now)

    def soon(self) -> None:
        """A watched calendar changed (on the loop): poll now, or again after the poll under way."""
        if self.job.running:
            self.again = True
        else:
            self.job.next_at = min(self.job.next_at, self.tools.clock.monotonic())

    def begin(self, now: float) -> None:
        run = self.job.begin(now)
        context = self.tools.context
        wall = self.tools.clock.now()
        # what each prepared or running session was given: its labels' times and GPUs
        live = [item for item in self.sessions() if item.state in ("created", "running")]
        holding = {session.key: (session.start, session.end) for session in live}
        holding_gpus = {session.key: session.gpu_count for session in live}
        self.tools.background(
            "poll",
            lambda: context.poll(wall, holding, holding_gpus),
            lambda result: self.returned(result, run),
        )

    def returned(self, result: Polled | Exception, run: int) -> None:
        if not self.job.is_current(run):
            log.warning("a calendar poll abandoned for its slowness finished after all; ignored")
            return
        self.job.finish(self.tools.clock.monotonic(), 0.0 if self.again else None)
        self.again = False
        if isinstance(result, Exception):
            log.error(
                "calendar poll failed unexpectedly; keeping the last reservations: %s", result
            )
            self.tools.counters.count_error("poll")
            return
        self.take(*result)

    def take(self, report: CalendarReport, new_rejections: list[Rejection]) -> None:
        """Take a poll's report in: the bookings, the vanish screen, the rejections."""
        context = self.tools.context
        self.report = report
        host = context.config.daemon.host
        mine = [item for item in report.reservations.reservations if item.host == host]
        now = self.tools.clock.now()
        with_session = {session.key for session in self.sessions()}
        screened = vanish.screen(
            self.polled, mine, with_session, self.hold, now, context.config.daemon.vanish_confirm
        )
        if screened.began and screened.hold is not None:
            self._vanish_began(screened.hold, len(mine))
        if screened.confirmed:
            log.warning("bookings missing for %s: the calendar is believed now", host)
        self.polled = mine
        self.hold = screened.hold
        self.reservations = list(screened.reservations)
        for rejection in new_rejections:
            context.reject(rejection)
        stale = [
            f"{name} ({freshness.last_error})"
            for name, freshness in report.freshness.items()
            if freshness.last_error
        ]
        if stale:
            self.tools.counters.count_error("calendar")
            systemd.status(f"calendar unreachable, using the last snapshot: {', '.join(stale)}")
        else:
            systemd.status(f"{len(self.reservations)} reservation(s) for {host}")
        self.on_polled()

    def reservation(self, key: str) -> Reservation | None:
        return next((item for item in self.reservations if item.key == key), None)

    def _vanish_began(self, hold: vanish.Hold, remaining: int) -> None:
        context = self.tools.context
        host = context.config.daemon.host
        keys = ", ".join(sorted(hold.keys))
        confirm = context.config.daemon.vanish_confirm
        context.notices.to_admin(
            f"vanish:{host}",
            f"vanish-{hold.since.isoformat()}",
            f"{len(hold.kept)} running bookings vanished from the calendar",
            f"The calendar poll at {hold.since.isoformat()} no longer lists {len(hold.kept)} "
            f"bookings that have a session on {host} ({keys}); "
            f"it lists {remaining} for this host.\n\nThis looks like a calendar problem "
            "(a server migration, a wrong URL, an emptied collection), so those sessions go "
            f"on as booked. If the bookings are still missing after {confirm}, the calendar "
            "is believed and they are stopped as cancelled.\n",
        )
