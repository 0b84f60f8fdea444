"""What is free on a host from now: per GPU, how long it stays free, or a count over time.

A pure function of the reservations the planner sees (accepted ones only),
the sessions and `now`, so that the status page and `gpuresa status` tell a
user what a walk-in booking can get. GPUs go to bookings as the planner gives
them: sessions keep the indices they hold, and bookings without a session get
theirs from `allocate_gpus`, earliest first, as `plan()` does when it prepares
them. On a host whose scheduler places GPUs itself (Slurm) the planner books a
count, not indices, so what is free is a count over time. A preemptible
session holds nothing a booking wants (it gives way, see
`gpuresa.planning.preemption`): its GPU shows free, with who gives way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, tzinfo

from gpuresa.model import Reservation, Session
from gpuresa.planning.allocation import Holding, Ports, allocate_gpus
from gpuresa.reservations.conflicts import site_time

# what a holding needs for ports, which the GPUs' story ignores
_NO_PORTS = Ports(0, 0, 0, -1)


@dataclass(frozen=True)
class Hold:
    """One session or booking holding GPUs over [start, end)."""

    key: str
    user: str
    start: datetime
    end: datetime
    count: int = 1
    preemptible: bool = False


@dataclass(frozen=True)
class GpuFree:
    """One GPU from now: who holds it now, and its next free interval.

    `holder`: the session or booking holding it now (None: free now);
    `free_from`: when the free interval starts (now, or when the holds that
    follow one another without a gap end); `free_until`: when it ends (None:
    free until further notice), and `ended_by` the booking that ends it;
    `yielding`: a preemptible session on it now, which gives way to a booking.
    """

    index: int
    holder: Hold | None
    free_from: datetime
    free_until: datetime | None
    ended_by: Hold | None
    yielding: Hold | None = None


@dataclass(frozen=True)
class CountFree:
    """How many of the host's GPUs are free over [start, end) (end None: from then on)."""

    start: datetime
    end: datetime | None
    free: int


def gpu_holds(
    reservations: Iterable[Reservation],
    sessions: Iterable[Session],
    host_gpus: tuple[int, ...],
    now: datetime,
) -> dict[int, list[Hold]]:
    """Which booking or session holds which of `host_gpus` when, as the planner allocates.

    Given the host's accepted reservations, its sessions and the GPU indices
    it hands out; returns per index the holds ending after `now`, by start.
    A session holds its indices until its booking ends (the planner extends
    it), or its own end when the booking is gone; a booking without a session
    gets the indices `allocate_gpus` gives it, earliest booking first, and
    none when none fit (the planner would refuse it).
    """
    wanted = {reservation.key: reservation for reservation in reservations}
    holdings: list[Holding] = []
    users: dict[str, str] = {}
    soft: set[str] = set()
    for session in sessions:
        reservation = wanted.get(session.key)
        if session.preemptible or (reservation is not None and reservation.preemptible):
            soft.add(session.key)
        start, end = session.start, session.end
        if reservation is not None:
            end = reservation.end
            if session.state == "created":
                # a prepared session waits for its booking's start
                start = reservation.start
        holdings.append(Holding(session.key, session.gpu_indices, _NO_PORTS, start, end))
        users[session.key] = session.user
    held = {holding.key for holding in holdings}
    firm = [holding for holding in holdings if holding.key not in soft]
    for reservation in sorted(wanted.values(), key=lambda item: (item.start, item.key)):
        if reservation.key in held or reservation.end <= now or reservation.gpus <= 0:
            continue
        if reservation.preemptible:
            continue  # it runs only where nothing else is wanted: it holds nothing
        chosen = allocate_gpus(
            host_gpus, reservation.gpus, reservation.start, reservation.end, firm
        )
        if chosen is None:
            continue
        holding = Holding(reservation.key, chosen, _NO_PORTS, reservation.start, reservation.end)
        holdings.append(holding)
        firm.append(holding)
        users[reservation.key] = reservation.user
    holds: dict[int, list[Hold]] = {index: [] for index in host_gpus}
    for holding in holdings:
        if holding.end <= now:
            continue
        for index in holding.gpus:
            if index in holds:
                holds[index].append(
                    Hold(
                        holding.key,
                        users[holding.key],
                        holding.start,
                        holding.end,
                        preemptible=holding.key in soft,
                    )
                )
    return {
        index: sorted(items, key=lambda hold: (hold.start, hold.key))
        for index, items in holds.items()
    }


def free_gpus(
    reservations: Iterable[Reservation],
    sessions: Iterable[Session],
    host_gpus: tuple[int, ...],
    now: datetime,
) -> list[GpuFree]:
    """Per GPU of `host_gpus` (by index), its holder now and its next free interval."""
    result = []
    for index, every in sorted(gpu_holds(reservations, sessions, host_gpus, now).items()):
        yielding = next((hold for hold in every if hold.preemptible and hold.start <= now), None)
        holds = [hold for hold in every if not hold.preemptible]
        holder = next((hold for hold in holds if hold.start <= now < hold.end), None)
        free_from = now
        # holds that follow one another without a gap keep the GPU busy
        covering = holder
        while covering is not None:
            free_from = covering.end
            covering = next((hold for hold in holds if hold.start <= free_from < hold.end), None)
        ended_by = next((hold for hold in holds if hold.start > free_from), None)
        result.append(
            GpuFree(
                index,
                holder,
                free_from,
                ended_by.start if ended_by else None,
                ended_by,
                yielding if holder is None else None,
            )
        )
    return result


def free_count(
    reservations: Iterable[Reservation],
    sessions: Iterable[Session],
    total: int,
    now: datetime,
) -> list[CountFree]:
    """For a host whose scheduler places GPUs: how many of its `total` are free when.

    Sessions hold their count until their booking ends (or their own end);
    bookings without a session hold theirs over their time. Returns the
    intervals from `now` on, each with its free count (never below 0: a
    scheduler may run more than one node's worth), the last one open-ended.
    """
    wanted = {reservation.key: reservation for reservation in reservations}
    holds: list[Hold] = []
    for session in sessions:
        reservation = wanted.get(session.key)
        end = reservation.end if reservation is not None else session.end
        holds.append(Hold(session.key, session.user, session.start, end, session.gpu_count))
    held = {hold.key for hold in holds}
    holds.extend(
        Hold(
            reservation.key, reservation.user, reservation.start, reservation.end, reservation.gpus
        )
        for reservation in wanted.values()
        if reservation.key not in held
    )
    holds = [hold for hold in holds if hold.end > now and hold.count > 0]
    instants = sorted(
        {now} | {hold.start for hold in holds if hold.start > now} | {hold.end for hold in holds}
    )
    steps: list[CountFree] = []
    for position, start in enumerate(instants):
        until = instants[position + 1] if position + 1 < len(instants) else None
        used = sum(hold.count for hold in holds if hold.start <= start < hold.end)
        free = max(0, total - used)
        if steps and steps[-1].free == free:
            # the same count on both sides of an instant: one interval
            steps[-1] = CountFree(steps[-1].start, until, free)
        else:
            steps.append(CountFree(start, until, free))
    return steps


def describe_gpu(item: GpuFree, zone: tzinfo) -> str:
    """One line for a user: "free now, until 2026-03-12 14:00 CET (alice's booking)",
    "free until further notice", "busy (bob, until …), then free until …"."""
    if item.free_until is None:
        until = "until further notice"
    else:
        owner = f" ({item.ended_by.user}'s booking)" if item.ended_by else ""
        until = f"until {site_time(item.free_until, zone)}{owner}"
    if item.holder is None:
        line = f"free {until}" if item.free_until is None else f"free now, {until}"
        if item.yielding is not None:
            line += f" ({item.yielding.user}'s preemptible session there gives way)"
        return line
    busy = f"busy ({item.holder.user}, until {site_time(item.holder.end, zone)})"
    if item.free_from != item.holder.end:
        # bookings follow the holder's without a gap
        return f"{busy}, then booked until {site_time(item.free_from, zone)}, then free {until}"
    return f"{busy}, then free {until}"


def describe_count(step: CountFree, total: int, zone: tzinfo) -> str:
    """One line for a count's interval: "3 of 4 GPUs free from … until …"."""
    until = "until further notice" if step.end is None else f"until {site_time(step.end, zone)}"
    return f"{step.free} of {total} GPU(s) free from {site_time(step.start, zone)} {until}"
