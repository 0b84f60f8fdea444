"""One user's bookings weighed against their limits: the ledger of what they took so far.

Pure, and memoized: `decide_user` depends on its arguments alone (the
bookings as plain `Booking` records, the clock already read into them), so
a poll that finds a user's bookings as the last one did reuses its answer;
that is what keeps the rules from adding time to a poll. What each limit
refuses is described in `gpuresa.fairshare.check`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, tzinfo
from functools import lru_cache
from typing import Any, NamedTuple

from gpuresa.config.schema import format_duration
from gpuresa.fairshare.limits import Limit
from gpuresa.fairshare.periods import Period, hours_within, period_name, period_of
from gpuresa.timeline import peak_gpus

# GPU-hours are sums of floats: a booking that fits exactly must not be refused by rounding
_SLACK = 1e-9
# the answers kept: one per user and state of their bookings (the latest are kept, so a
# site of up to this many active users finds each user's answer from the last poll)
_REMEMBERED = 512


class Booking(NamedTuple):
    """What the rules know of one booking; records sort in the order they are weighed.

    waits: False for a booking that holds its session (weighed first, never
    refused); seen: when gpuresa first saw it; to_come: whether it starts
    after the reading's time.
    """

    waits: bool
    seen: datetime
    start: datetime
    key: str
    end: datetime
    gpus: int
    to_come: bool


@lru_cache(maxsize=_REMEMBERED)
def decide_user(
    user: str,
    bookings: tuple[Booking, ...],
    counted: tuple[Booking, ...],
    limits: tuple[tuple[str, Limit], ...],
    period: Period,
    zone: tzinfo,
) -> tuple[tuple[str, str], ...]:
    """(key, reason) of each of `user`'s bookings that a limit refuses.

    `bookings`: the user's, sorted (the order that decides, see `Booking`);
    `counted`: bookings that ran and that the calendars no longer list, which
    count first; `limits`: the user's (`gpuresa.fairshare.limits.limits_for`),
    in the order of LIMIT_KEYS; `period` and `zone`: max_gpu_hours' periods.
    """
    ledger = Ledger(user, limits, Periods(period, zone))
    for booking in counted:
        ledger.add(booking)
    refused: list[tuple[str, str]] = []
    for booking in bookings:
        reason = ledger.refusal(booking) if booking.waits else None
        if reason is None:
            ledger.add(booking)
        else:
            # refused: counts for nothing
            refused.append((booking.key, reason))
    return tuple(refused)


class Periods:
    """The site's periods met so far, so that each is worked out once per decision."""

    def __init__(self, period: Period, zone: tzinfo) -> None:
        self.period = period
        self.zone = zone
        self.known: list[tuple[datetime, datetime]] = []

    def containing(self, instant: datetime) -> tuple[datetime, datetime]:
        for bounds in self.known:
            if bounds[0] <= instant < bounds[1]:
                return bounds
        bounds = period_of(instant, self.period, self.zone)
        self.known.append(bounds)
        return bounds

    def over(self, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
        """Every period [start, end) meets, in order (as `periods_over`)."""
        found = [self.containing(start)]
        while found[-1][1] < end:
            found.append(self.containing(found[-1][1]))
        return found


class Ledger:
    """One user's limits and the bookings of theirs taken so far."""

    def __init__(self, user: str, limits: Sequence[tuple[str, Limit]], periods: Periods) -> None:
        self.user = user
        self.periods = periods
        self.period = periods.period
        self.zone = periods.zone
        # each limit's check, given the limit's value (a count, GPU-hours or a duration)
        checks: dict[str, Callable[[Booking, Any], str | None]] = {
            "max_duration": self._max_duration,
            "max_ahead": self._max_ahead,
            "max_gpus": self._max_gpus,
            "max_bookings": self._max_bookings,
            "min_gap": self._min_gap,
            "max_gpu_hours": self._max_gpu_hours,
        }
        self.checks = [(key, limit, checks[key]) for key, limit in limits]
        keys = {key for key, _ in limits}
        self.counts_hours = "max_gpu_hours" in keys
        # only max_gpus and min_gap look for the bookings near another: the others keep none
        self.keeps_times = "max_gpus" in keys or "min_gap" in keys
        # the bookings taken, sorted by start, to find overlaps by bisection
        self.starts: list[datetime] = []
        self.taken: list[Booking] = []  # in the same order
        self.longest = timedelta(0)
        self.to_come = 0
        # GPU-hours taken in each period met, by its bounds
        self.hours: dict[tuple[datetime, datetime], float] = {}
        self.split: tuple[Booking, list[tuple[tuple[datetime, datetime], float]]] | None = None

    def add(self, item: Booking) -> None:
        if self.keeps_times:
            index = bisect_right(self.starts, item.start)
            self.starts.insert(index, item.start)
            self.taken.insert(index, item)
            length = item.end - item.start
            if length > self.longest:
                self.longest = length
        if item.to_come:
            self.to_come += 1
        if self.counts_hours:
            for bounds, used in self.gpu_hours(item):
                self.hours[bounds] = self.hours.get(bounds, 0.0) + used

    def meeting(self, start: datetime, end: datetime) -> list[Booking]:
        """The bookings taken that overlap [start, end), by start."""
        low = bisect_left(self.starts, start - self.longest)
        high = bisect_left(self.starts, end)
        return [item for item in self.taken[low:high] if item.end > start]

    def refusal(self, item: Booking) -> str | None:
        """Why `item` breaks a limit (the first broken, in the order of LIMIT_KEYS), or None."""
        for key, limit, check in self.checks:
            reason = check(item, limit.value)
            if reason is not None:
                return f"rule {key} ({limit.source}): {reason}"
        return None

    def _max_duration(self, item: Booking, longest: timedelta) -> str | None:
        length = item.end - item.start
        if length <= longest:
            return None
        return (
            f"this booking lasts {format_duration(length)}; a booking of {self.user} may last "
            f"{format_duration(longest)} at most"
        )

    def _max_ahead(self, item: Booking, furthest: timedelta) -> str | None:
        ahead = item.start - item.seen
        if ahead <= furthest:
            return None
        return (
            f"this booking starts {format_duration(ahead)} after gpuresa first saw it "
            f"({_at(item.seen, self.zone)}); {self.user} may book {format_duration(furthest)} "
            "ahead at most"
        )

    def _max_gpus(self, item: Booking, most: int) -> str | None:
        held = peak_gpus(self.meeting(item.start, item.end), item.start, item.end)
        if held + item.gpus <= most:
            return None
        return (
            f"{self.user} holds {held} GPU(s) during this time, of {most} at once at most; "
            f"this booking asks for {item.gpus}"
        )

    def _max_bookings(self, item: Booking, most: int) -> str | None:
        if not item.to_come or self.to_come < most:
            return None
        return f"{self.user} has {self.to_come} booking(s) still to come, of {most} at most"

    def _min_gap(self, item: Booking, gap: timedelta) -> str | None:
        if gap <= timedelta(0):
            return None
        near = self.meeting(item.start - gap, item.end + gap)
        if not near:
            return None
        other = near[0]
        when = f"{_at(other.start, self.zone)} to {_at(other.end, self.zone)}"
        if other.end <= item.start:
            between = f"ends {format_duration(item.start - other.end)} before this one starts"
        elif other.start >= item.end:
            between = f"starts {format_duration(other.start - item.end)} after this one ends"
        else:
            between = "overlaps this one"
        return (
            f"another booking of {self.user} ({when}) {between}; bookings of {self.user} must be "
            f"{format_duration(gap)} apart at least"
        )

    def gpu_hours(self, item: Booking) -> list[tuple[tuple[datetime, datetime], float]]:
        """The GPU-hours `item` takes in each period it meets (worked out once per booking:
        its check and its adding both ask)."""
        if self.split is None or self.split[0] is not item:
            parts = [
                (bounds, item.gpus * hours_within(item.start, item.end, bounds))
                for bounds in self.periods.over(item.start, item.end)
            ]
            self.split = (item, parts)
        return self.split[1]

    def _max_gpu_hours(self, item: Booking, most: float) -> str | None:
        for bounds, asked in self.gpu_hours(item):
            used = self.hours.get(bounds, 0.0)
            if used + asked <= most + _SLACK:
                continue
            left = max(most - used, 0.0)
            name = period_name(bounds, self.period, self.zone)
            preposition = "on" if self.period == "day" else "in"
            return (
                f"{self.user} has {_figure(left)} of {_figure(most)} GPU-hours left "
                f"{preposition} {name}; this booking asks for {_figure(asked)}"
            )
        return None


def _figure(hours: float) -> str:
    """GPU-hours as a reason shows them: "8", "7.5", "0.25"."""
    return f"{hours:.2f}".rstrip("0").rstrip(".")


def _at(instant: datetime, zone: tzinfo) -> str:
    """An instant in the site's zone, with the zone's name, as over-booking refusals say it."""
    return instant.astimezone(zone).strftime("%Y-%m-%d %H:%M %Z")
