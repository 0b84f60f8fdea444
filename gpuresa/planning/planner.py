"""The planner: what the calendar wants against what Docker runs, as a list of actions.

`plan()` is pure: it reads no clock, touches no Docker and no network, so the
poll, the exact-time triggers, a restart and `gpuresa plan` all get the same
answer from the same facts. `gpuresa.daemon` carries the actions out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta

from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session, SessionSpec, is_ad_hoc
from gpuresa.planning.actions import (
    Action,
    Extend,
    Fail,
    NotifyCancel,
    NotifyChange,
    Prepare,
    Recreate,
    Start,
    Stop,
    Warn,
)
from gpuresa.planning.allocation import Holding, Ports, new_spec, preempts, scheduled
from gpuresa.planning.facts import Inventory, Memory
from gpuresa.planning.preemption import (
    NO_PORTS,
    Soft,
    give_way,
    place_preemptible,
    project_firm,
)
from gpuresa.planning.release import release_action


def plan(
    reservations: Iterable[Reservation],
    sessions: Iterable[Session],
    inventory: Inventory,
    now: datetime,
    config: Config,
    memory: Memory = Memory(),
) -> list[Action]:
    """The actions that bring the sessions in line with the reservations at `now`.

    Given this host's reservations (validated, conflicts resolved), the
    sessions Docker runs for this host, the inventory, and the memory of
    earlier rounds; returns the actions in the order they must run (stops
    first). Raises nothing: a reservation that cannot be served becomes a
    `Fail` action.
    """
    daemon = config.daemon
    wanted = {
        reservation.key: reservation
        for reservation in reservations
        if reservation.host == inventory.host.name
    }
    existing = {session.key: session for session in sessions}
    actions: list[Action] = []

    # firm sessions' GPUs; preemptible ones' (over their whole bookings) apart: they give way
    holdings: list[Holding] = []
    soft: Soft = Soft(preempts(inventory))
    taken_ports: list[Ports] = [Ports(port, port, port, port) for port in memory.refused_ports]
    # what actions under way are taking (their containers may not be in Docker yet)
    for key, spec in memory.in_flight.items():
        if spec is not None and key not in existing:
            held = Holding(key, spec.gpu_indices, _ports_of(spec), spec.start, spec.end)
            soft.held.append(held) if soft.on and spec.preemptible else holdings.append(held)
            taken_ports.append(_ports_of(spec))
    # prepared sessions whose booking changed under them: removed and prepared anew
    replanned: set[str] = set()
    prepared: list[tuple[Session, Reservation]] = []

    for key, session in existing.items():
        reservation = wanted.get(key)
        # ports stay bound until the containers are gone, whatever happens this round
        taken_ports.append(_ports_of(session))
        preemptible = soft.on and (
            session.preemptible or bool(reservation and reservation.preemptible)
        )
        # what the session holds goes with the firm ones, or apart when it gives way
        held_by = soft.held if preemptible else holdings
        if key in memory.in_flight:
            # one action at a time per session: its GPUs stay held until it is done,
            # unless it is being stopped
            if key not in memory.stopping:
                end = max(session.end, reservation.end) if reservation else session.end
                held_by.append(
                    Holding(key, session.gpu_indices, _ports_of(session), session.start, end)
                )
            continue
        stop = _stop_for(session, reservation, now, config, memory)
        if stop is not None:
            actions.append(stop)
            continue
        if reservation is None:
            # a missing booking keeps its GPUs only until its grace period ends
            end = session.end
            if not is_ad_hoc(key):
                end = min(end, memory.missing_deadline(session.key, now, config))
            held_by.append(
                Holding(key, session.gpu_indices, _ports_of(session), session.start, end)
            )
            if preemptible:
                soft.running.append(key)  # it gives way until its grace is over, too
            actions.extend(_missing_notices(session, now, config, memory))
            continue
        if session.state == "created":
            (soft.prepared if preemptible else prepared).append((session, reservation))
            continue
        release = None if preemptible else release_action(session, reservation, now, config, memory)
        if release is not None:
            actions.append(release)
            if isinstance(release, Stop):
                continue
        held_by.append(
            Holding(key, session.gpu_indices, _ports_of(session), session.start, reservation.end)
        )
        if preemptible:
            soft.running.append(key)
        if reservation.user != session.user:
            # the booking was given to someone else: the old user's session ends
            # (with a notice), and the new user's starts in a later round
            actions.append(Stop(key, reason="reassigned", grace=daemon.stop_grace))
            continue
        if reservation.end != session.end:
            actions.append(Extend(key, end=reservation.end))
        change = _running_change(session, reservation, inventory)
        if change and (key, change) not in memory.changes_notified:
            actions.append(
                NotifyChange(key, change=change, user=session.user, email=reservation.email)
            )
        spec = _spec_from_session(session, reservation)
        if session.state == "stopped" and now >= reservation.start:
            if memory.may_try(key, now):
                actions.append(Recreate(key, spec=spec))
        elif session.state == "running":
            warning = _due_warning(key, reservation.end, now, daemon.warnings, memory)
            if warning is not None:
                actions.append(Warn(key, before=warning, end=reservation.end))

    # prepared sessions last, so they are checked against every session that runs
    for session, reservation in prepared:
        key = session.key
        if _prepared_differs(session, reservation, inventory, now, config, holdings):
            actions.append(Stop(key, reason="replan", grace=timedelta(0)))
            replanned.add(key)
            continue
        holdings.append(
            Holding(
                key, session.gpu_indices, _ports_of(session), reservation.start, reservation.end
            )
        )
        if reservation.end != session.end:
            actions.append(Extend(key, end=reservation.end))
        if now >= reservation.start and memory.may_try(key, now):
            actions.append(Start(key, spec=_spec_from_session(session, reservation)))

    upcoming = [
        reservation
        for reservation in wanted.values()
        if (reservation.key not in existing or reservation.key in replanned)
        and reservation.key not in memory.in_flight
        and reservation.key not in memory.preempted | memory.released
        and now < reservation.end
    ]
    projected: dict[str, Holding] = {}
    if soft.on and (soft.held or soft.prepared or any(item.preemptible for item in upcoming)):
        firm_upcoming = [item for item in upcoming if not item.preemptible]
        projected = project_firm(inventory.gpus, firm_upcoming, holdings)
        actions = give_way(soft, [*holdings, *projected.values()], actions, now, config, memory)

    # new sessions, earliest first so an earlier booking gets its GPUs first
    for reservation in sorted(upcoming, key=lambda item: (item.start, item.key)):
        key = reservation.key
        if now < reservation.start - daemon.prepare_ahead:
            continue
        if not memory.may_try(key, now):
            continue
        if soft.on and reservation.preemptible:
            placement = place_preemptible(
                inventory.gpus, reservation, [*holdings, *projected.values()], soft.keeping(),
                now, config,
            )  # fmt: skip
            if placement is None:
                continue  # it waits for idle GPUs; nobody is refused for it
            spec_or_reason = new_spec(reservation, inventory, holdings, taken_ports, placement.gpus)
            if isinstance(spec_or_reason, str):
                continue
            soft.placed.append(
                Holding(key, placement.gpus, NO_PORTS, reservation.start, placement.until)
            )
        elif key in projected:
            gpus = projected[key].gpus
            spec_or_reason = new_spec(reservation, inventory, holdings, taken_ports, gpus)
        else:
            spec_or_reason = new_spec(reservation, inventory, holdings, taken_ports)
        if isinstance(spec_or_reason, str):
            actions.append(
                Fail(key, reason=spec_or_reason, user=reservation.user, email=reservation.email)
            )
            continue
        spec = spec_or_reason
        if not spec.preemptible:
            holdings.append(
                Holding(key, spec.gpu_indices, _ports_of(spec), reservation.start, reservation.end)
            )
        taken_ports.append(_ports_of(spec))
        actions.append(
            Start(key, spec=spec) if now >= reservation.start else Prepare(key, spec=spec)
        )
    return sorted(actions, key=lambda action: (action.order, action.key))


def _prepared_differs(
    session: Session,
    reservation: Reservation,
    inventory: Inventory,
    now: datetime,
    config: Config,
    holdings: list[Holding],
) -> bool:
    """Whether a prepared (not started) session no longer fits its booking.

    The booking changed user, template, CUDA variant or GPU count; it moved out
    of the prepare window; or a running session was extended over its GPUs.
    """
    if (session.user, session.template, session.cuda) != (
        reservation.user,
        reservation.template,
        reservation.cuda,
    ):
        return True
    if inventory.host.gpu_mode != "none" and session.gpu_count != reservation.gpus:
        return True
    if now < reservation.start - config.daemon.prepare_ahead:
        return True
    if scheduled(inventory):
        # the node's GPUs are the scheduler's to count; a booking moved to another node
        # is prepared again there
        node = reservation.place
        return bool(node) and not node.startswith("partition:") and node != session.place
    for holding in holdings:
        overlaps = holding.start < reservation.end and reservation.start < holding.end
        if overlaps and set(holding.gpus) & set(session.gpu_indices):
            return True
    return False


def _running_change(session: Session, reservation: Reservation, inventory: Inventory) -> str:
    """What the booking of a running session changed that the session cannot follow, or ""."""
    changes = []
    if reservation.template != session.template:
        changes.append(f"template {session.template} → {reservation.template}")
    elif reservation.cuda is not None and reservation.cuda != session.cuda:
        changes.append(f"CUDA {session.cuda} → {reservation.cuda}")
    if inventory.host.gpu_mode != "none" and reservation.gpus != session.gpu_count:
        changes.append(f"GPUs {session.gpu_count} → {reservation.gpus}")
    return ", ".join(changes)


def _stop_for(
    session: Session,
    reservation: Reservation | None,
    now: datetime,
    config: Config,
    memory: Memory,
) -> Stop | None:
    """A Stop when the session must end now, else None."""
    grace = config.daemon.stop_grace
    if reservation is not None:
        if now >= reservation.end:
            return Stop(session.key, reason="ended", grace=grace)
        return None
    if is_ad_hoc(session.key):
        # an ad-hoc session runs to the end it was given
        return Stop(session.key, reason="ended", grace=grace) if now >= session.end else None
    if now >= session.end:
        return Stop(session.key, reason="ended", grace=grace)
    reason = "cancelled" if session.key in memory.known else "orphan"
    if session.state == "created":
        # prepared but never started: nobody uses it, so no grace period
        return Stop(session.key, reason=reason, grace=grace)
    if now >= memory.missing_deadline(session.key, now, config):
        return Stop(session.key, reason=reason, grace=grace)
    return None


def _missing_notices(
    session: Session, now: datetime, config: Config, memory: Memory
) -> list[Action]:
    """Tell the user of a cancelled booking, once; orphans have nobody to tell."""
    if is_ad_hoc(session.key) or session.key not in memory.known:
        return []
    if session.key in memory.cancel_notified or session.state != "running":
        return []
    since = memory.missing_since.get(session.key, now)
    if now - since < config.daemon.poll_interval:
        # one poll without the booking may be a bad read; wait for the next to confirm
        return []
    deadline = min(memory.missing_deadline(session.key, now, config), session.end)
    return [NotifyCancel(session.key, stop_at=deadline)]


def _due_warning(
    key: str,
    end: datetime,
    now: datetime,
    warnings: tuple[timedelta, ...],
    memory: Memory,
) -> timedelta | None:
    """The most urgent warning due and not yet sent (after a restart, only that one)."""
    due = [
        warning
        for warning in warnings
        if end - warning <= now < end
        and (key, int(warning.total_seconds())) not in memory.warnings_sent
    ]
    return min(due) if due else None


def _spec_from_session(session: Session, reservation: Reservation) -> SessionSpec:
    """The spec of an existing session: its GPUs, ports and node (the one the backend
    chose stays the session's), the reservation's times."""
    return replace(
        session.spec,
        start=reservation.start,
        end=reservation.end,
        email=reservation.email or session.email,
    )


def _ports_of(item: Session | SessionSpec) -> Ports:
    return Ports(item.ssh_port, item.ftp_port, item.ftp_passive_first, item.ftp_passive_last)
