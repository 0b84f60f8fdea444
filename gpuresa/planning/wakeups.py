"""When the planner's answer may change: the instants the daemon plans again at, exactly.

Pure like `planner.plan`, and given the same facts.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session, is_ad_hoc
from gpuresa.planning.facts import Inventory, Memory
from gpuresa.planning.preemption import gone_before
from gpuresa.planning.release import release_wakeups


def wakeups(
    reservations: Iterable[Reservation],
    sessions: Iterable[Session],
    inventory: Inventory,
    now: datetime,
    config: Config,
    memory: Memory = Memory(),
) -> list[datetime]:
    """Every future instant at which `plan()` may answer differently, sorted.

    The daemon schedules an exact-time reconcile at each, so a session starts,
    gets its warnings and ends on time rather than at the next poll.
    """
    daemon = config.daemon
    reservations = list(reservations)
    sessions = list(sessions)
    wanted_keys = {reservation.key for reservation in reservations}
    instants: set[datetime] = set()
    for reservation in reservations:
        if reservation.host != inventory.host.name:
            continue
        instants.add(reservation.start - daemon.prepare_ahead)
        instants.add(reservation.start)
        instants.add(reservation.end)
        instants.update(reservation.end - warning for warning in daemon.warnings)
        instants.update(release_wakeups(reservation, config, memory))
    for session in sessions:
        instants.add(session.end)
        if session.key not in wanted_keys and not is_ad_hoc(session.key):
            instants.add(memory.missing_deadline(session.key, now, config))
    instants.update(memory.retry_after.values())
    if any(item.preemptible for item in reservations) or any(item.preemptible for item in sessions):
        # a preemptible session is told, then stopped, before each firm booking's start
        for reservation in reservations:
            if reservation.host == inventory.host.name and not reservation.preemptible:
                stop = gone_before(reservation.start, config)
                instants.update((stop, stop - daemon.preempt_notice))
    return sorted(instant for instant in instants if instant > now)
