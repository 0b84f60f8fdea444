"""What is free on this host from now, as the status page and `gpuresa status` show it.

`free_view` asks the planning side (`gpuresa.planning.free_gpus`) once; the
page and the CLI only word the answer, in the site's zone with its name, so
a user reads what a walk-in booking can get without a second allocator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import Config, HostConfig
from gpuresa.journal.store import Journal
from gpuresa.model import Reservation, Session
from gpuresa.planning.free_gpus import (
    CountFree,
    GpuFree,
    Hold,
    describe_count,
    describe_gpu,
    free_count,
    free_gpus,
)

# journal states of a booking whose GPUs the planner no longer gives it
_NOT_HOLDING = frozenset({"rejected", "cancelled", "ended", "removed", "preempted", "released"})


@dataclass(frozen=True)
class FreeView:
    """Per GPU its holder and next free interval; or, where a scheduler places GPUs,
    how many of the host's `total` are free when (`total` is None for the former)."""

    gpus: tuple[GpuFree, ...] = ()
    counts: tuple[CountFree, ...] = ()
    total: int | None = None


def free_view(
    reservations: Iterable[Reservation],
    sessions: Iterable[Session],
    host_gpus: tuple[int, ...],
    places_gpus: bool,
    now: datetime,
) -> FreeView:
    """What is free from `now`, given this host's accepted reservations and its sessions."""
    reservations, sessions = list(reservations), list(sessions)
    if places_gpus:
        # the planner books a count; the scheduler picks the devices
        total = len(host_gpus)
        return FreeView(counts=tuple(free_count(reservations, sessions, total, now)), total=total)
    return FreeView(gpus=tuple(free_gpus(reservations, sessions, host_gpus, now)))


def still_booked(
    reservations: Iterable[Reservation],
    host: str,
    state_of: Callable[[str], str | None],
    rejected: Iterable[str],
) -> list[Reservation]:
    """The journal's reservations of `host` that the planner still sees: neither rejected
    (now or by their last state) nor cancelled, ended or removed."""
    refused = set(rejected)
    return [
        reservation
        for reservation in reservations
        if reservation.host == host
        and reservation.key not in refused
        and state_of(reservation.key) not in _NOT_HOLDING
    ]


def free_report(
    config: Config,
    host: HostConfig | None,
    sessions: list[Session],
    journal: Journal,
    rejected: Iterable[str],
    now: datetime,
) -> dict[str, Any]:
    """What `gpuresa status` says is free from `now`: from the journal's bookings the
    planner still sees and the backend's sessions, sentences in the site's zone."""
    from gpuresa.gpus.devices import HostGpus

    booked = still_booked(
        journal.reservations.all(ending_after=now), config.daemon.host, journal.states.get, rejected
    )
    host_gpus = HostGpus().indices(host) if host else ()
    view = free_view(booked, sessions, host_gpus, host_capabilities(host).places_gpus, now)
    return free_json(view, ZoneInfo(config.reservations.timezone))


def free_lines(view: FreeView, zone: tzinfo) -> list[tuple[str, str]]:
    """(label, sentence) rows: ("GPU 0", "free now, until … (alice's booking)"), or for a
    count ("GPUs", "3 of 4 GPU(s) free from … until …")."""
    if view.total is not None:
        return [("GPUs", describe_count(step, view.total, zone)) for step in view.counts]
    return [(f"GPU {item.index}", describe_gpu(item, zone)) for item in view.gpus]


def free_json(view: FreeView, zone: tzinfo) -> dict[str, Any]:
    """What `gpuresa status --json` says under "free": instants in UTC, a sentence in `zone`."""
    if view.total is not None:
        return {
            "mode": "count",
            "total": view.total,
            "intervals": [
                {
                    "from": _iso(step.start),
                    "until": _iso(step.end),
                    "free": step.free,
                    "text": describe_count(step, view.total, zone),
                }
                for step in view.counts
            ],
        }
    return {
        "mode": "gpus",
        "gpus": [
            {
                "index": item.index,
                "holder": _hold(item.holder),
                "free_from": _iso(item.free_from),
                "free_until": _iso(item.free_until),
                "ended_by": _hold(item.ended_by),
                "text": describe_gpu(item, zone),
            }
            for item in view.gpus
        ],
    }


def _hold(hold: Hold | None) -> dict[str, Any] | None:
    if hold is None:
        return None
    return {"key": hold.key, "user": hold.user, "from": _iso(hold.start), "until": _iso(hold.end)}


def _iso(instant: datetime | None) -> str | None:
    return instant.astimezone(UTC).isoformat() if instant else None
