"""Prometheus metrics of the published `ObservedState`, through a custom collector.

The collector reads the state box only: scraping never reaches Docker, NVML or
the journal, and a slow scrape never slows the daemon. Labels carry logins
and reservation keys, never e-mail addresses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gpuresa.inert import inert
from gpuresa.observe.state import ObservedState

SESSION_STATES = ("created", "running", "stopped")


class StateCollector(Collector):
    """Yields gpuresa's metrics from `provider()` at each scrape."""

    def __init__(self, provider: Callable[[], ObservedState]) -> None:
        self.provider = provider

    def collect(self) -> Iterator[Metric]:
        state = self.provider()
        yield from self._sessions(state)
        yield from self._gpus(state)
        yield from self._calendars(state)
        yield from self._usage(state)
        for action, histogram in sorted(state.latency.items()):
            buckets = [(str(float(bound)), count) for bound, count in histogram.buckets]
            buckets.append(("+Inf", histogram.count))
            yield HistogramMetricFamily(
                f"gpuresa_session_{action}_seconds",
                f"How long each session {action} took, from its action to done",
                buckets=buckets,
                sum_value=histogram.total,
            )
        errors = CounterMetricFamily(
            "gpuresa_errors", "Errors by kind since the daemon started", labels=["kind"]
        )
        for kind, count in sorted(state.errors.items()):
            errors.add_metric([kind], count)
        yield errors
        if state.outbox_backlog is not None:
            yield GaugeMetricFamily(
                "gpuresa_outbox_backlog", "Mails waiting in the outbox", value=state.outbox_backlog
            )
        yield GaugeMetricFamily(
            "gpuresa_state_timestamp_seconds",
            "When the daemon last published this picture (Unix time)",
            value=state.taken.timestamp(),
        )

    def _sessions(self, state: ObservedState) -> Iterator[Metric]:
        sessions = GaugeMetricFamily(
            "gpuresa_sessions", "Sessions on this host by state", labels=["state"]
        )
        counts = Counter(session.state for session in state.sessions)
        for name in sorted(set(SESSION_STATES) | set(counts)):
            sessions.add_metric([name], counts.get(name, 0))
        yield sessions
        yield GaugeMetricFamily(
            "gpuresa_reservations_upcoming",
            "Reservations on this host not started yet",
            value=len(state.upcoming),
        )
        yield GaugeMetricFamily(
            "gpuresa_reservations_rejected",
            "Bookings rejected (bad or conflicting), not yet past",
            value=len(state.rejected),
        )
        yield GaugeMetricFamily(
            "gpuresa_unbooked_processes",
            "Processes on a GPU outside the sessions that booked it",
            value=len(state.unbooked),
        )

    def _gpus(self, state: ObservedState) -> Iterator[Metric]:
        labels = ["gpu", "uuid", "user", "key"]
        utilization = GaugeMetricFamily(
            "gpuresa_gpu_utilization_percent",
            "GPU utilization with the booking that holds it (user and key empty: free)",
            labels=labels,
        )
        memory = GaugeMetricFamily(
            "gpuresa_gpu_memory_used_bytes", "GPU memory in use", labels=labels
        )
        for gpu in state.gpus:
            # keys are event UIDs: inert, so no control or bidi character reaches a label
            values = [
                inert(item) for item in (str(gpu.index), gpu.uuid, gpu.user or "", gpu.key or "")
            ]
            if gpu.utilization is not None:
                utilization.add_metric(values, gpu.utilization)
            if gpu.memory_used is not None:
                memory.add_metric(values, gpu.memory_used)
        yield utilization
        yield memory
        booked = [gpu for gpu in state.gpus if gpu.key is not None]
        yield GaugeMetricFamily("gpuresa_gpus", "GPUs the host shows", value=len(state.gpus))
        yield GaugeMetricFamily(
            "gpuresa_gpus_booked", "GPUs held by a running session", value=len(booked)
        )
        yield GaugeMetricFamily(
            "gpuresa_gpus_idle",
            "GPUs held by a session that has stayed under the idle threshold too long",
            value=sum(1 for gpu in booked if gpu.idle),
        )
        yield GaugeMetricFamily(
            "gpuresa_telemetry_up",
            "1 when the last GPU sample could be read",
            value=1 if state.telemetry_error is None else 0,
        )

    def _calendars(self, state: ObservedState) -> Iterator[Metric]:
        success = GaugeMetricFamily(
            "gpuresa_calendar_last_success_timestamp_seconds",
            "When each calendar was last read (Unix time)",
            labels=["calendar"],
        )
        age = GaugeMetricFamily(
            "gpuresa_calendar_age_seconds",
            "Seconds since each calendar was last read",
            labels=["calendar"],
        )
        up = GaugeMetricFamily(
            "gpuresa_calendar_up", "1 when the last read of a calendar worked", labels=["calendar"]
        )
        for calendar in state.calendars:
            name = inert(calendar.name)
            up.add_metric([name], 0 if calendar.last_error else 1)
            if calendar.last_success is not None:
                success.add_metric([name], calendar.last_success.timestamp())
                stale = state.taken - calendar.last_success
                age.add_metric([name], stale.total_seconds())
        yield success
        yield age
        yield up

    def _usage(self, state: ObservedState) -> Iterator[Metric]:
        """GPU-seconds booked (by group and login) and used (by group) since the daemon
        started; labels chosen in `gpuresa.reports.live`."""
        if state.usage is None:
            return
        booked = CounterMetricFamily(
            "gpuresa_gpu_seconds_booked",
            "GPU-seconds booked on this host since the daemon started, by group and login",
            labels=["group", "user"],
        )
        for (group, user), seconds in sorted(state.usage.booked_seconds.items()):
            booked.add_metric([inert(group), inert(user)], seconds)
        yield booked
        used = CounterMetricFamily(
            "gpuresa_gpu_seconds_used",
            "GPU-seconds the booked GPUs were busy (held × utilization) since the daemon "
            "started, by group",
            labels=["group"],
        )
        for group, seconds in sorted(state.usage.used_seconds.items()):
            used.add_metric([inert(group)], seconds)
        yield used


def registry_for(provider: Callable[[], ObservedState]) -> CollectorRegistry:
    """A registry holding only gpuresa's collector (no process or platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(provider))
    return registry
