"""Preemptible sessions: idle GPUs put to work, and given back before a firm booking needs them.

A preemptible booking claims nothing (`reservations.conflicts` keeps it
whatever the others ask); the planner runs it only on GPUs no firm booking
needs, and ends it before one does. Pure, like the rest of the planner: the
same facts give the same answer, so a restart or `gpuresa plan` agrees.

Three steps, each a function here:

1. `project_firm`: where every firm booking will run, for the whole calendar
   window, with the choice the planner makes when it prepares it: the lowest
   GPUs free of firm sessions and bookings, as if no preemptible session ran
   (`place_firm`). So a firm booking gets the GPUs and the start it would get
   on a host without preemptible sessions, and the GPUs a preemptible session
   was stopped for are the ones the booking then gets.
2. `deadlines`: for each preemptible session, when it must be gone: its stop
   (`stop_grace`, and `STOP_MARGIN` for the removal) is over before the first
   firm use of any of its GPUs begins.
3. `place_preemptible`: GPUs for a new preemptible session: free now, the
   ones that stay free longest (highest indices on a tie, away from where
   firm bookings are placed first), and only where it can run at least
   `daemon.preempt_minimum` (or its whole booking).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session
from gpuresa.planning.actions import Action, Extend, NotifyPreempt, Start, Stop
from gpuresa.planning.allocation import Holding, Ports, allocate_gpus
from gpuresa.planning.facts import Memory

# What a stop takes beyond its grace period: SIGKILL, removal, ports freed.
STOP_MARGIN = timedelta(seconds=5)
NO_PORTS = Ports(0, 0, 0, 0)


@dataclass
class Soft:
    """The preemptible sessions of one planning round (`on`: the host can preempt).

    held: their holdings over their whole bookings; running: those that run
    (or are stopped, to be made again); prepared: those made but not started;
    placed: those placed this round (over the time they may keep their GPUs);
    stopping: those told to stop this round.
    """

    on: bool
    held: list[Holding] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    prepared: list[tuple[Session, Reservation]] = field(default_factory=list)
    placed: list[Holding] = field(default_factory=list)
    stopping: set[str] = field(default_factory=set)
    until: dict[str, datetime] = field(default_factory=dict)

    def keeping(self) -> list[Holding]:
        """What the preemptible sessions hold, each until it must be gone."""
        kept = [
            replace(holding, end=self.until.get(holding.key, holding.end))
            for holding in self.held
            if holding.key not in self.stopping
        ]
        return kept + self.placed


@dataclass(frozen=True)
class Placement:
    """GPUs for a preemptible session, and when it must be gone from them."""

    gpus: tuple[int, ...]
    until: datetime


def gone_before(firm_start: datetime, config: Config) -> datetime:
    """When a preemptible session's stop must begin for its GPUs to be free at `firm_start`."""
    return firm_start - config.daemon.stop_grace - STOP_MARGIN


def place_firm(
    available: tuple[int, ...], reservation: Reservation, firm: Sequence[Holding]
) -> tuple[int, ...] | None:
    """A firm booking's GPUs: the lowest free of firm ones, as if no preemptible session ran.

    Preemptible sessions are not looked at, so that every firm booking gets
    the GPUs and the start it would get without them (they take the highest
    indices first, so they are rarely in the way).
    """
    return allocate_gpus(available, reservation.gpus, reservation.start, reservation.end, firm)


def project_firm(
    available: tuple[int, ...], upcoming: Iterable[Reservation], firm: Sequence[Holding]
) -> dict[str, Holding]:
    """Where each upcoming firm booking (no session yet) will run, earliest first.

    Bookings that will not fit are left out: their own start fails as today.
    """
    placed: dict[str, Holding] = {}
    holdings = list(firm)
    for reservation in sorted(upcoming, key=lambda item: (item.start, item.key)):
        chosen = place_firm(available, reservation, holdings)
        if chosen is None:
            continue
        holding = Holding(reservation.key, chosen, NO_PORTS, reservation.start, reservation.end)
        placed[reservation.key] = holding
        holdings.append(holding)
    return placed


def deadlines(
    preemptible: Iterable[Holding],
    firm: Iterable[Holding],
    now: datetime,
    config: Config,
) -> dict[str, datetime]:
    """For each preemptible session (its holding over its whole booking): when it must go.

    The instant its stop must begin so that every firm use of its GPUs
    (sessions and projected bookings) finds them free; its booking's end when
    no firm use comes first. Never before `now`.
    """
    firm = list(firm)
    found: dict[str, datetime] = {}
    for holding in preemptible:
        until = holding.end
        for other in firm:
            shared = set(other.gpus) & set(holding.gpus)
            overlaps = other.start < holding.end and holding.start < other.end
            if shared and overlaps and other.end > now:
                until = min(until, gone_before(other.start, config))
        found[holding.key] = max(until, now)
    return found


def place_preemptible(
    available: tuple[int, ...],
    reservation: Reservation,
    firm: Iterable[Holding],
    others: Iterable[Holding],
    now: datetime,
    config: Config,
) -> Placement | None:
    """GPUs for a preemptible booking starting at max(now, its start), or None (it waits).

    `firm`: firm sessions and projected bookings; `others`: the other
    preemptible sessions over the time they keep their GPUs. A GPU counts if
    nothing holds it at the start; it stays free until the next firm use
    (less the stop that must be over by then) or the next preemptible
    session's start.
    """
    begin = max(now, reservation.start)
    free_until: dict[int, datetime] = {index: reservation.end for index in available}
    limits = [(holding, gone_before(holding.start, config)) for holding in firm]
    limits += [(holding, holding.start) for holding in others]
    for holding, limit in limits:
        if holding.end <= begin or holding.start >= reservation.end:
            continue
        for index in holding.gpus:
            if index not in free_until:
                continue
            if limit <= begin:
                del free_until[index]
            else:
                free_until[index] = min(free_until[index], limit)
    if reservation.gpus <= 0 or len(free_until) < reservation.gpus:
        return None
    ranked = sorted(free_until, key=lambda index: (free_until[index], index), reverse=True)
    chosen = tuple(sorted(ranked[: reservation.gpus]))
    until = min(free_until[index] for index in chosen)
    if until < reservation.end and until - begin < config.daemon.preempt_minimum:
        return None
    return Placement(chosen, until)


def give_way(
    soft: Soft,
    firm: Sequence[Holding],
    actions: list[Action],
    now: datetime,
    config: Config,
    memory: Memory,
) -> list[Action]:
    """`actions` with what the preemptible sessions must do this round.

    A running one is told once, `preempt_notice` before it must be gone, and
    stopped then ("preempted": the stop of a session that ends, output kept);
    its other actions of the round are dropped. A prepared one that could no
    longer run `preempt_minimum` is removed at once (nobody uses it yet) and
    waits for idle GPUs again; else it starts at its time.
    """
    daemon = config.daemon
    for session, reservation in soft.prepared:
        soft.held.append(
            Holding(session.key, session.gpu_indices, NO_PORTS, reservation.start, reservation.end)
        )
    soft.until = deadlines(soft.held, firm, now, config)
    ends = {holding.key: holding.end for holding in soft.held}
    for key in soft.running:
        until = soft.until[key]
        if until >= ends[key]:
            continue  # nothing firm comes first: it ends with its booking, like any other
        if now >= until:
            actions = [action for action in actions if action.key != key]
            actions.append(Stop(key, reason="preempted", grace=daemon.stop_grace))
            soft.stopping.add(key)
        elif now >= until - daemon.preempt_notice and memory.preempt_notified.get(key) != until:
            # told of this stop time (a new one, earlier or later, is told again)
            actions.append(NotifyPreempt(key, stop_at=until))
    for session, reservation in soft.prepared:
        key, until = session.key, soft.until[session.key]
        begin = max(now, reservation.start)
        if until < reservation.end and until - begin < daemon.preempt_minimum:
            actions.append(Stop(key, reason="replan", grace=timedelta(0)))
            soft.stopping.add(key)
            continue
        if reservation.end != session.end:
            actions.append(Extend(key, end=reservation.end))
        if now >= reservation.start and memory.may_try(key, now):
            spec = replace(session.spec, start=reservation.start, end=reservation.end)
            actions.append(Start(key, spec=spec))
    return actions
