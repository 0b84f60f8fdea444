"""Usage figures over a period, per user, group, host or GPU, from rows already read (pure).

`usage_report(facts, period, by, group_of, now)` takes what the journal and
the GPU usage store hold (`UsageFacts`: bookings, the intervals their
sessions held GPUs, each session's telemetry, refusals) and returns one
`UsageRow` per key, with a total. No clock, no I/O: `gpuresa.reports.reading`
reads the rows.

The figures, in GPU-hours (an hour of one GPU):

- **booked**: each booking's interval ∩ the period × its GPU count. A booking
  cancelled (or rejected) after it was accepted counts up to that moment
  only: its GPUs were free for others afterwards.
- **held**: the time a session held its GPUs, from the change to "running"
  until the first change to a state other than running, warned or stopping
  (ended, preempted, cancelled, failed, removed, or booked again on a
  re-plan), ∩ the period × the GPU count. A session still running is held
  until `now`, or its booking's end if that comes first (the daemon stops it
  then; one that died meanwhile leaves a holding that never ends).
- **busy**: held × the session's mean GPU utilization (NVML's utilization is
  the share of time a kernel ran, so utilization × time is the time the GPUs
  worked). The usage store keeps one mean per session, not a time series, so
  a session that crosses the period's edge is taken to work evenly.
- **unmeasured**: held GPU-hours of sessions without telemetry (a Slurm host,
  `[telemetry] backend = "none"`, GPUs that never answered): their busy time
  is unknown, not zero.
- **sessions**, **no-shows**: sessions that started holding GPUs in the period,
  and those among them nobody used: released for want of a login
  (`release_unused`, the state "released"), or with GPUs never busy (mean
  utilization under `NO_SHOW_PERCENT` over at least one sample). The journal
  keeps no login once a session is over, so a session used over SSH without
  the GPUs counts as a no-show too; a session without telemetry is one only
  when released.
- **refused**: refusals whose booking starts in the period (when a refusal
  has no start, when it was first seen), by `reason_class`.

Sessions the journal holds no booking for (ad-hoc `gpuresa session start`)
are not bookings and are left out.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from gpuresa.reports.reasons import reason_class

By = Literal["user", "group", "host", "gpu"]
BY_CHOICES: tuple[By, ...] = ("user", "group", "host", "gpu")

# states in which a session holds its GPUs; any other ends the holding
HOLDING_STATES = frozenset({"running", "warned", "stopping"})
# states that end a booking early: counted as booked up to the change
# (released: nobody logged in in time; its GPUs went back to walk-ins for the rest)
WITHDRAWN_STATES = frozenset({"cancelled", "rejected", "released"})
# the state that ends a session nobody logged into (`release_unused`): a no-show
RELEASED = "released"
# a session whose mean utilization stays under this (percent) never used its GPUs
NO_SHOW_PERCENT = 1.0
# the row of a GPU not known: a booking never started, or a host that places GPUs itself
UNPLACED = "?"
TOTAL = "total"
HOUR = 3600.0

# how `gpuresa.planning.actions.Start.describe` names the GPUs in the journal
_START_GPUS = re.compile(r"\(GPUs \[([0-9, ]*)\]")


@dataclass(frozen=True)
class Period:
    """The instants [start, end) a report covers (aware datetimes)."""

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f"a period must end after it starts ({self.start} → {self.end})")

    def overlap(self, start: datetime, end: datetime) -> float:
        """Seconds of [start, end) inside the period (0 when they do not meet)."""
        seconds = (min(end, self.end) - max(start, self.start)).total_seconds()
        return max(0.0, seconds)


@dataclass(frozen=True)
class Booking:
    """A booking as the journal keeps it; `withdrawn_at`: when it was cancelled or rejected
    (it is so now), None otherwise; `gpu_indices`: the GPUs its session started on (() when
    not known)."""

    key: str
    user: str
    host: str
    gpus: int
    start: datetime
    end: datetime
    withdrawn_at: datetime | None = None
    gpu_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class StateChange:
    """A journal row "`key` entered `state` at `at`"."""

    key: str
    at: datetime
    state: str


@dataclass(frozen=True)
class Telemetry:
    """One session's GPU use as the usage store keeps it: samples and mean utilization."""

    key: str
    samples: int
    mean_utilization: float | None


@dataclass(frozen=True)
class Refusal:
    """A refused booking: whose, on which host (or calendar), why, and when it counts."""

    key: str
    user: str | None
    host: str
    reason: str
    at: datetime


@dataclass(frozen=True)
class Holding:
    """One interval a session held its GPUs, and the state that ended it (None: it still
    holds them, `end` is None)."""

    start: datetime
    end: datetime | None
    ended_by: str | None


@dataclass(frozen=True)
class UsageFacts:
    """Everything a report is computed from (see the module docstring)."""

    bookings: Sequence[Booking] = ()
    # each booking's holdings by key, in time order (see `held_intervals`)
    holdings: Mapping[str, Sequence[Holding]] = field(default_factory=dict)
    telemetry: Mapping[str, Telemetry] = field(default_factory=dict)
    refusals: Sequence[Refusal] = ()


@dataclass
class UsageRow:
    """The figures of one key (GPU-hours, counts); see the module docstring."""

    key: str
    booked: float = 0.0
    held: float = 0.0
    busy: float = 0.0
    unmeasured: float = 0.0
    sessions: int = 0
    no_shows: int = 0
    refused: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class UsageReport:
    """Rows by key (sorted), their total, and what they cover."""

    period: Period
    by: By
    rows: tuple[UsageRow, ...]
    total: UsageRow


def held_intervals(changes: Iterable[StateChange]) -> dict[str, list[Holding]]:
    """Each key's intervals of holding its GPUs (see `HOLDING_STATES`), from its changes.

    Changes are taken in time order (a key's changes of one instant in the order
    given). The journal reader computes the same in SQL (`gpuresa.reports.reading`);
    this is its definition, which the tests hold the SQL to.
    """
    intervals: dict[str, list[Holding]] = {}
    opened: dict[str, datetime] = {}
    for change in sorted(changes, key=lambda item: item.at):
        holding = change.key in opened
        if change.state == "running" and not holding:
            opened[change.key] = change.at
        elif change.state not in HOLDING_STATES and holding:
            start = opened.pop(change.key)
            intervals.setdefault(change.key, []).append(Holding(start, change.at, change.state))
    for key, start in opened.items():
        intervals.setdefault(key, []).append(Holding(start, None, None))
    return intervals


def start_gpus(description: str) -> tuple[int, ...]:
    """The GPU indices a journaled start action names ("start k for u (GPUs [0, 1], …)")."""
    found = _START_GPUS.search(description)
    if found is None:
        return ()
    return tuple(int(part) for part in found.group(1).replace(" ", "").split(",") if part)


def _keys(booking: Booking, by: By, group_of: Callable[[str], str]) -> list[tuple[str, int]]:
    """The rows a booking counts in and the GPUs it counts there."""
    if by == "user":
        return [(booking.user, booking.gpus)]
    if by == "group":
        return [(group_of(booking.user), booking.gpus)]
    if by == "host":
        return [(booking.host, booking.gpus)]
    if booking.gpu_indices:
        return [(f"{booking.host}:{index}", 1) for index in booking.gpu_indices]
    return [(f"{booking.host}:{UNPLACED}", booking.gpus)]


def _refusal_key(refusal: Refusal, by: By, group_of: Callable[[str], str]) -> str:
    if by == "user":
        return refusal.user or UNPLACED
    if by == "group":
        return group_of(refusal.user) if refusal.user else UNPLACED
    if by == "host":
        return refusal.host
    return f"{refusal.host}:{UNPLACED}"


def usage_report(
    facts: UsageFacts,
    period: Period,
    by: By,
    group_of: Callable[[str], str],
    now: datetime,
) -> UsageReport:
    """The figures of `period` per `by` key (see the module docstring).

    `group_of` gives a login's group (for `by="group"`); `now` closes the
    sessions still holding GPUs. Raises ValueError for an unknown `by`.
    """
    if by not in BY_CHOICES:
        raise ValueError(f"a report is by {', '.join(BY_CHOICES)}, not {by!r}")
    rows: dict[str, UsageRow] = {}

    def row(key: str) -> UsageRow:
        found = rows.get(key)
        if found is None:
            found = rows[key] = UsageRow(key)
        return found

    total = UsageRow(TOTAL)
    for booking in facts.bookings:
        end = booking.end
        if booking.withdrawn_at is not None:
            end = min(end, max(booking.withdrawn_at, booking.start))
        booked_hours = period.overlap(booking.start, end) / HOUR
        intervals = facts.holdings.get(booking.key, ())
        # a holding the journal never saw end lasts until now, and until the booking's end
        # at the latest: the daemon stops sessions then, one that died must not hold for ever
        held_hours = (
            sum(period.overlap(item.start, item.end or min(now, booking.end)) for item in intervals)
            / HOUR
        )
        started_here = any(period.start <= item.start < period.end for item in intervals)
        released = any(item.ended_by == RELEASED for item in intervals)
        if not (booked_hours or held_hours or started_here):
            continue
        use = facts.telemetry.get(booking.key)
        mean = None
        if use is not None and use.samples > 0 and use.mean_utilization is not None:
            mean = min(max(use.mean_utilization, 0.0), 100.0)
        # the total counts each booking once, whatever rows (GPUs) it spreads over
        for target, gpus in [(total, booking.gpus)] + [
            (row(key), gpus) for key, gpus in _keys(booking, by, group_of)
        ]:
            target.booked += booked_hours * gpus
            target.held += held_hours * gpus
            if mean is not None:
                target.busy += held_hours * gpus * mean / 100.0
            else:
                target.unmeasured += held_hours * gpus
            if started_here:
                target.sessions += 1
                if released or (mean is not None and mean < NO_SHOW_PERCENT):
                    target.no_shows += 1
    for refusal in facts.refusals:
        if period.start <= refusal.at < period.end:
            kind = reason_class(refusal.reason)
            row(_refusal_key(refusal, by, group_of)).refused[kind] += 1
            total.refused[kind] += 1
    return UsageReport(period, by, tuple(rows[key] for key in sorted(rows)), total)


def week_start(now: datetime) -> datetime:
    """Monday 00:00 of `now`'s week, in `now`'s own time zone (give it in the site's).

    Wall-clock arithmetic: across a DST change the result is still Monday 00:00.
    """
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return midnight - timedelta(days=midnight.weekday())
