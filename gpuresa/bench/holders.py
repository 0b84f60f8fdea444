"""Which GPUs a bench must not touch: those of sessions and of bookings about to start.

Pure: the sessions Docker shows, the reservations the journal last read from
the calendars, and the planner decide; nothing is read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime

from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session
from gpuresa.planning.actions import Prepare, Recreate, Start
from gpuresa.planning.facts import Inventory
from gpuresa.planning.planner import plan


def gpu_holders(
    sessions: Iterable[Session],
    reservations: Iterable[Reservation],
    inventory: Inventory,
    now: datetime,
    until: datetime,
    config: Config,
) -> dict[int, str]:
    """GPU index -> who holds it between `now` and `until`, for people.

    Every session Docker shows holds its GPUs, whatever its state (a stopped
    one may be recreated). A booking that starts before `until` holds the
    GPUs the planner would give it: `plan()` is asked at `now` as if the
    daemon prepared sessions `until - now` ahead, so its Prepare and Start
    actions name the very GPUs the daemon is going to hand out (the daemon
    cannot see a bench, and would give them to the booking all the same).
    """
    sessions = list(sessions)
    holders: dict[int, str] = {}
    for session in sessions:
        for index in session.gpu_indices:
            holders.setdefault(index, f"session {session.key} of {session.user}")
    ahead = max(config.daemon.prepare_ahead, until - now)
    lookahead = dataclasses.replace(
        config, daemon=dataclasses.replace(config.daemon, prepare_ahead=ahead)
    )
    for action in plan(reservations, sessions, inventory, now, lookahead):
        if isinstance(action, Prepare | Start | Recreate) and action.spec is not None:
            spec = action.spec
            if spec.start < until and now < spec.end:
                for index in spec.gpu_indices:
                    holders.setdefault(
                        index,
                        f"booking {spec.key} of {spec.user} from {spec.start:%Y-%m-%d %H:%M} UTC",
                    )
    return holders
