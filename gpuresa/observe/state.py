"""The observed state: one immutable picture the daemon publishes, scrapes and pages read.

The daemon builds it with `build_state` after each round and each GPU sample
and hands it to a `Published` box; the metrics collector and the status page
only read the box, so a scrape never touches Docker, NVML or the journal.
Nothing in it carries a password, an FTP login or an e-mail address.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gpuresa.gpus.findings import UnbookedProcess
from gpuresa.gpus.readings import GpuSnapshot
from gpuresa.gpus.tracker import TrackerView
from gpuresa.gpus.usage_store import SessionUse
from gpuresa.model import Rejection, Reservation, Session
from gpuresa.observe.free import FreeView, free_view
from gpuresa.planning.allocation import Holding, Ports, allocate_gpus
from gpuresa.reports.live import UsageView

# seconds; a start pulls nothing and builds nothing, a stop waits its grace
LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


@dataclass(frozen=True)
class SessionView:
    key: str
    user: str
    state: str
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    ssh_port: int
    utilization: float | None = None
    average_utilization: float | None = None
    idle: bool = False
    lost: bool = False


@dataclass(frozen=True)
class GpuView:
    index: int
    uuid: str
    name: str
    utilization: int | None
    memory_used: int | None
    memory_total: int | None
    key: str | None = None
    user: str | None = None
    idle: bool = False


@dataclass(frozen=True)
class BookingView:
    """An upcoming reservation; `gpus` are the indices it would get now (() if none fit)."""

    key: str
    user: str
    template: str
    start: datetime
    end: datetime
    count: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class RejectedView:
    key: str
    user: str | None
    reason: str
    start: datetime | None = None


@dataclass(frozen=True)
class CalendarView:
    name: str
    last_success: datetime | None
    last_error: str | None


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts per upper bound (seconds), as Prometheus wants them."""

    buckets: tuple[tuple[float, int], ...] = tuple((bound, 0) for bound in LATENCY_BUCKETS)
    count: int = 0
    total: float = 0.0


@dataclass(frozen=True)
class ObservedState:
    host: str
    taken: datetime
    gpus: tuple[GpuView, ...] = ()
    sessions: tuple[SessionView, ...] = ()
    upcoming: tuple[BookingView, ...] = ()
    rejected: tuple[RejectedView, ...] = ()
    calendars: tuple[CalendarView, ...] = ()
    unbooked: tuple[UnbookedProcess, ...] = ()
    telemetry_source: str = "none"
    telemetry_error: str | None = None
    outbox_backlog: int | None = None
    errors: Mapping[str, int] = field(default_factory=dict)
    latency: Mapping[str, Histogram] = field(default_factory=dict)
    # what is free from `taken` on, per GPU or as a count (gpuresa.observe.free)
    free: FreeView = field(default_factory=FreeView)
    # this week's usage and the GPU-seconds counters (gpuresa.reports.live); None: not read
    usage: UsageView | None = None


class Counters:
    """Start/stop latencies and errors by kind, counted by the daemon's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latency: dict[str, list[float]] = {}
        self._errors: dict[str, int] = {}

    def observe_latency(self, action: str, seconds: float) -> None:
        """Count one `action` ("start", "stop") that took `seconds`."""
        with self._lock:
            self._latency.setdefault(action, []).append(seconds)
            # keep the figures bounded on a daemon that runs for months
            if len(self._latency[action]) > 10_000:
                self._latency[action] = self._latency[action][-5_000:]

    def count_error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + 1

    def errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)

    def histograms(self) -> dict[str, Histogram]:
        with self._lock:
            figures = {action: list(values) for action, values in self._latency.items()}
        return {
            action: Histogram(
                tuple((bound, sum(1 for v in values if v <= bound)) for bound in LATENCY_BUCKETS),
                len(values),
                sum(values),
            )
            for action, values in figures.items()
        }


class Published:
    """The latest `ObservedState`, swapped whole under a lock (readers never wait on work)."""

    def __init__(self, initial: ObservedState) -> None:
        self._lock = threading.Lock()
        self._state = initial

    def publish(self, state: ObservedState) -> None:
        with self._lock:
            self._state = state

    def current(self) -> ObservedState:
        with self._lock:
            return self._state


def _planned(
    upcoming: Sequence[Reservation], sessions: Sequence[Session], host_gpus: tuple[int, ...]
) -> list[BookingView]:
    """Upcoming bookings with the GPUs they would get if allocated now, earliest first."""
    nowhere = Ports(0, 0, 0, -1)
    holdings = [Holding(s.key, s.gpu_indices, nowhere, s.start, s.end) for s in sessions]
    views = []
    for reservation in sorted(upcoming, key=lambda item: (item.start, item.key)):
        gpus = allocate_gpus(
            host_gpus, reservation.gpus, reservation.start, reservation.end, holdings
        )
        if gpus is not None:
            holdings.append(
                Holding(reservation.key, gpus, nowhere, reservation.start, reservation.end)
            )
        views.append(
            BookingView(
                reservation.key,
                reservation.user,
                reservation.template,
                reservation.start,
                reservation.end,
                reservation.gpus,
                gpus or (),
            )
        )
    return views


def build_state(
    *,
    host: str,
    now: datetime,
    sessions: Sequence[Session],
    reservations: Iterable[Reservation] = (),
    rejections: Iterable[Rejection] = (),
    calendars: Iterable[CalendarView] = (),
    snapshot: GpuSnapshot | None = None,
    uses: Mapping[str, SessionUse] | None = None,
    view: TrackerView | None = None,
    host_gpus: tuple[int, ...] = (),
    counters: Counters | None = None,
    outbox_backlog: int | None = None,
    places_gpus: bool = False,
) -> ObservedState:
    """The picture of this host at `now`, from what the daemon already holds (no I/O).

    `reservations` are the accepted ones the planner sees; `places_gpus`: the
    host's scheduler places GPUs itself, so what is free is shown as a count.
    """
    reservations = [item for item in reservations if item.host == host]
    uses = uses or {}
    view = view or TrackerView()
    snapshot = snapshot or GpuSnapshot(now, "none", error="not sampled yet")
    holder = {index: s for s in sessions if s.state == "running" for index in s.gpu_indices}
    session_views = tuple(
        SessionView(
            s.key,
            s.user,
            s.state,
            s.gpu_indices,
            s.start,
            s.end,
            s.ssh_port,
            uses[s.key].current_utilization if s.key in uses else None,
            uses[s.key].average_utilization if s.key in uses else None,
            s.key in view.idle,
            s.key in view.lost,
        )
        for s in sorted(sessions, key=lambda item: (item.start, item.key))
    )
    gpu_views = tuple(
        GpuView(
            gpu.index,
            gpu.uuid,
            gpu.name,
            gpu.utilization,
            gpu.memory_used,
            gpu.memory_total,
            holder[gpu.index].key if gpu.index in holder else None,
            holder[gpu.index].user if gpu.index in holder else None,
            gpu.index in holder and holder[gpu.index].key in view.idle,
        )
        for gpu in snapshot.gpus
    )
    running_keys = {s.key for s in sessions}
    upcoming = [
        r for r in reservations if r.key not in running_keys and r.host == host and r.end > now
    ]
    gpus = host_gpus or tuple(gpu.index for gpu in snapshot.gpus)
    return ObservedState(
        host=host,
        taken=now.astimezone(UTC),
        gpus=gpu_views,
        sessions=session_views,
        upcoming=tuple(_planned(upcoming, sessions, gpus)),
        rejected=tuple(
            RejectedView(item.key, item.user, item.reason, item.start) for item in rejections
        ),
        calendars=tuple(calendars),
        unbooked=view.unbooked,
        telemetry_source=snapshot.source,
        telemetry_error=snapshot.error,
        outbox_backlog=outbox_backlog,
        errors=counters.errors() if counters else {},
        latency=counters.histograms() if counters else {},
        free=free_view(reservations, sessions, gpus, places_gpus, now),
    )
