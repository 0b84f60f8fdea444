"""Over-booking, decided across calendars: which bookings keep a host's GPUs.

On one host, a booking whose session is already prepared or running keeps it;
between the others, the one gpuresa saw first (the journal's first sight)
wins, then the UID. CREATED and DTSTAMP do not count: whoever writes the event
writes them. Pure: no I/O, no clock.
"""

from __future__ import annotations

import logging
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from datetime import UTC, datetime, timedelta, tzinfo
from types import MappingProxyType
from zoneinfo import ZoneInfo

from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import Config, HostConfig
from gpuresa.model import Rejection, Reservation, ReservationSet
from gpuresa.timeline import peak_gpus

log = logging.getLogger(__name__)


_LATEST = datetime.max.replace(tzinfo=UTC)
# defaults of the keyword arguments: nothing seen, granted or counted
NOTHING_SEEN: Mapping[str, datetime] = MappingProxyType({})
NOTHING_GRANTED: Mapping[str, tuple[datetime, datetime]] = MappingProxyType({})
NO_COUNTS: Mapping[str, int] = MappingProxyType({})


def reservation_order(reservation: Reservation) -> tuple[datetime, str]:
    """The sort key of kept reservations: start, then key."""
    return reservation.start, reservation.key


def rejection_order(rejection: Rejection) -> tuple[datetime, str]:
    """The sort key of rejections: start (none first), then key."""
    return rejection.start or datetime.min.replace(tzinfo=UTC), rejection.key


def _booking_order(
    reservation: Reservation, first_seen: Mapping[str, datetime], holding: AbstractSet[str]
) -> tuple[object, ...]:
    """Who keeps the GPUs: a booking whose session is prepared or running, then the one
    gpuresa saw first (a key it never saw counts as seen now, the newest), then the UID.

    Not CREATED or DTSTAMP: whoever writes the event writes those too.
    """
    return (
        reservation.key not in holding,
        first_seen.get(reservation.key, _LATEST),
        reservation.uid,
        reservation.start,
        reservation.key,
    )


def _conflict_reason(
    reservation: Reservation,
    winner: Reservation,
    used: int,
    count: int,
    first_seen: Mapping[str, datetime],
    holding: AbstractSet[str],
    zone: tzinfo,
) -> str:
    """Why `reservation` loses to `winner`, for its user: when the other is (in the site's
    `zone`), why, the GPU count."""
    if winner.key in holding:
        why = "which already runs"
    elif first_seen.get(winner.key, _LATEST) < first_seen.get(reservation.key, _LATEST):
        why = "which was booked first"
    else:
        why = "which was booked at the same time (the UID decides)"
    # the other booking is someone else's: named by its time only, never by its text or UID
    other = f"{site_time(winner.start, zone)} to {site_time(winner.end, zone)}"
    return (
        f"overlaps another booking on host {reservation.host} from {other} {why}: the host has "
        f"{count} GPU(s) and {used} of them are taken during this time "
        f"(this one asks for {reservation.gpus})"
    )


def site_time(instant: datetime, zone: tzinfo) -> str:
    """`instant` as a refusal gives every time: in the site's zone, with the zone's name
    ("2026-03-12 09:00 CET"), so that one line never mixes zones."""
    return instant.astimezone(zone).strftime("%Y-%m-%d %H:%M %Z")


def resolve_conflicts(
    reservations: Iterable[Reservation],
    config: Config,
    *,
    first_seen: Mapping[str, datetime] = NOTHING_SEEN,
    holding: AbstractSet[str] = frozenset(),
    granted: Mapping[str, tuple[datetime, datetime]] = NOTHING_GRANTED,
    granted_gpus: Mapping[str, int] = NO_COUNTS,
    preemptible: AbstractSet[str] = frozenset(),
) -> ReservationSet:
    """Decide over-booking: on each host, the bookings with the better claim keep their GPUs.

    Given validated reservations (of any calendars), when gpuresa first saw
    each booking (by key; the journal's `first_seen_times`) and the keys
    whose session is already prepared or running (`holding`), returns those
    that fit, sorted by start then key, and a rejection "overlaps <winner>
    which already runs / which was booked first: …" for each that would make
    overlapping reservations on its host ask for more GPUs than the host has.
    Reservations are taken in `_booking_order`: each is kept if, at every
    instant of its time, it fits with the ones already kept; so extending a
    booking into the slot of a running one never stops the running one.
    Hosts whose GPU count gpuresa does not know (`host_gpu_count` is None)
    keep everything: their runtime decides.

    `granted` holds the interval each prepared, running or ended session was
    given (by key; such a key counts as holding). A booking holds its granted
    time, not its rank: the part of its new times inside that interval comes
    first, the rest (a growth) is weighed after every other booking; a growth
    that does not fit is refused alone (a rejection keyed `<key>/growth`) and
    the booking is kept within its granted time. Shortening is always taken.
    `granted_gpus` holds the GPU count each such session was given: a raise
    of `gpus:` is a growth like a longer time (weighed last, refused alone);
    a lower count is taken, but the granted time still counts the GPUs the
    session holds (a running session keeps the GPUs it started with).

    A preemptible booking claims nothing: it is kept whatever the others ask
    (the planner runs it only on GPUs no firm booking needs) and counts for
    none of them. `preemptible` holds the keys ever seen preemptible: such a
    booking stays preemptible whatever it says now, so that a booking written
    preemptible (which no firm booking was refused for) cannot turn firm once
    it runs, or once seen, and take the GPUs that were promised to others.
    """
    reservations = [
        replace(item, preemptible=True)
        if item.key in preemptible and not item.preemptible
        else item
        for item in reservations
    ]
    hosts = {host.name: host for host in config.hosts}
    zone = ZoneInfo(config.reservations.timezone)
    kept: list[Reservation] = []
    rejected: list[Rejection] = []
    by_host: dict[str, list[Reservation]] = {}
    for reservation in reservations:
        by_host.setdefault(reservation.host, []).append(reservation)
    for host_name, candidates in by_host.items():
        host = hosts.get(host_name)
        count = host_gpu_count(host) if host is not None else None
        if count is None:
            kept.extend(candidates)
            continue
        kept_here = _Timeline()
        for item in [item for item in candidates if item.preemptible]:
            candidates.remove(item)
            if item.gpus <= count:
                kept.append(item)
            else:
                reason = f"{item.gpus} GPUs asked, but host {host_name!r} has {count}"
                rejected.append(Rejection.of(item, reason))
        # a booking moved wholly out of its granted time holds nothing, like any other,
        # whatever `holding` says: its granted time is what it holds
        holders = {key for key in holding if key not in granted} | {
            item.key
            for item in candidates
            if item.key in granted
            and item.start < granted[item.key][1]
            and granted[item.key][0] < item.end
        }
        candidates.sort(key=lambda item: _booking_order(item, first_seen, holders))
        # what holders were granted comes first; their growth, last
        ordered, growths = _granted_first(candidates, granted, granted_gpus)
        for reservation, counted in ordered:
            if reservation.gpus > count:
                # read_calendar rejects these already; a caller's own list may hold one
                reason = f"{reservation.gpus} GPUs asked, but host {host_name!r} has {count}"
            else:
                blocking = kept_here.blocking(counted, count)
                if blocking is None:
                    kept_here.add(counted)
                    kept.append(reservation)
                    continue
                used, winner = blocking
                reason = _conflict_reason(
                    reservation, winner, used, count, first_seen, holders, zone
                )
            log.debug("%s: rejected: %s", reservation.key, reason)
            rejected.append(Rejection.of(reservation, reason))
        for clipped, whole in growths:
            if clipped not in kept:
                continue
            refusal = _grow(clipped, whole, kept_here, count, first_seen, holders, zone)
            if refusal is None:
                kept[kept.index(clipped)] = whole
            else:
                log.debug("%s: growth refused: %s", whole.key, refusal.reason)
                rejected.append(refusal)
    kept.sort(key=reservation_order)
    rejected.sort(key=rejection_order)
    return ReservationSet(tuple(kept), tuple(rejected))


def _granted_first(
    candidates: list[Reservation],
    granted: Mapping[str, tuple[datetime, datetime]],
    granted_gpus: Mapping[str, int],
) -> tuple[list[tuple[Reservation, Reservation]], list[tuple[Reservation, Reservation]]]:
    """The candidates with each holder cut to what it was granted, and the holders that grew.

    Given candidates in `_booking_order`; returns (reservation, counted) for
    each: a booking whose new times meet its granted interval is cut to
    their intersection and to at most its granted GPU count, and counted on
    the timeline with the GPUs its session holds (the granted count, when
    the booking now asks fewer); and (cut, whole) for each whose new times
    or GPU count reach beyond what it was granted. A booking moved wholly
    out of its granted time stays as it is.
    """
    order: list[tuple[Reservation, Reservation]] = []
    growths: list[tuple[Reservation, Reservation]] = []
    for reservation in candidates:
        interval = granted.get(reservation.key)
        start, end = reservation.start, reservation.end
        if interval is not None:
            start, end = max(start, interval[0]), min(end, interval[1])
        if interval is None or start >= end:
            order.append((reservation, reservation))
            continue
        held = granted_gpus.get(reservation.key, reservation.gpus)
        cut = replace(reservation, start=start, end=end, gpus=min(reservation.gpus, held))
        order.append((cut, replace(cut, gpus=max(cut.gpus, held))))
        if cut != reservation:
            growths.append((cut, reservation))
    return order, growths


def _grow(
    cut: Reservation,
    whole: Reservation,
    timeline: _Timeline,
    count: int,
    first_seen: Mapping[str, datetime],
    holders: AbstractSet[str],
    zone: tzinfo,
) -> Rejection | None:
    """Add what `whole` asks beyond its granted `cut` (more time, more GPUs), or the
    refusal of that growth."""
    parts = [
        replace(whole, start=start, end=end)
        for start, end in ((whole.start, cut.start), (cut.end, whole.end))
        if start < end
    ]
    if whole.gpus > cut.gpus:
        # the GPUs asked beyond the granted count, during the granted time
        parts.append(replace(cut, gpus=whole.gpus - cut.gpus))
    for part in parts:
        blocking = timeline.blocking(part, count)
        if blocking is not None:
            used, winner = blocking
            why = _conflict_reason(part, winner, used, count, first_seen, holders, zone)
            asked = f"{site_time(whole.start, zone)} – {site_time(whole.end, zone)}"
            kept = f"{site_time(cut.start, zone)} – {site_time(cut.end, zone)}"
            if whole.gpus > cut.gpus:
                asked += f" with {whole.gpus} GPU(s)"
                kept += f" with {cut.gpus} GPU(s)"
            reason = (
                f"the change to {asked} is not taken; the session keeps {kept}, what it "
                f"was given: the change {why}"
            )
            return Rejection.of(whole, reason, key=f"{whole.key}/growth")
    for part in parts:
        timeline.add(part)
    return None


class _Timeline:
    """The reservations kept on one host, sorted by start, to find overlaps fast.

    They are added in `_booking_order`, so the lower a reservation's index, the
    better its claim.
    """

    def __init__(self) -> None:
        self.starts: list[tuple[datetime, int]] = []
        self.items: list[Reservation] = []
        self.longest = timedelta(0)

    def add(self, reservation: Reservation) -> None:
        insort(self.starts, (reservation.start, len(self.items)))
        self.items.append(reservation)
        self.longest = max(self.longest, reservation.end - reservation.start)

    def blocking(self, reservation: Reservation, count: int) -> tuple[int, Reservation] | None:
        """None if `reservation` fits beside the kept ones; else the most GPUs they use at
        once during its time, and the one with the best claim among those that overlap it."""
        start, end = reservation.start, reservation.end
        low = bisect_left(self.starts, (start - self.longest, -1))
        high = bisect_left(self.starts, (end, -1))
        items = self.items
        overlapping = [index for _, index in self.starts[low:high] if items[index].end > start]
        if not overlapping:
            return None
        # the peak use during this reservation
        peak = peak_gpus([items[index] for index in overlapping], start, end)
        if peak + reservation.gpus <= count:
            return None
        return peak, items[min(overlapping)]


def host_gpu_count(host: HostConfig) -> int | None:
    """How many GPUs bookings on `host` may share; None when gpuresa does not count them.

    A list of GPU indices gives the count. `gpus = "auto"` leaves the count to
    the runtime (it asks nvidia-smi on that host), and `gpu_mode = "none"`
    hands no GPU to sessions: for both, None means that a booking's GPU count
    has no upper bound here and over-booking is decided later, by the runtime
    on the host itself.
    """
    if host.gpu_mode == "none" or host.gpus == "auto" or host_capabilities(host).places_gpus:
        # a cluster's GPUs are per node: its backend refuses what a node cannot hold
        return None
    return len(host.gpus)
