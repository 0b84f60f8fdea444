"""What the journal tells the fair-share rules: first sights, sessions held, bookings that ran.

The edge between the journal and the pure rules (`gpuresa.fairshare.check`),
shared by the daemon and by `gpuresa plan` and `gpuresa reservations`, so
that the commands refuse what the daemon refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo

from gpuresa.config.sections import Config
from gpuresa.fairshare.periods import period_of
from gpuresa.journal.store import Journal
from gpuresa.model import Reservation

# journal states of bookings that have (or had) their session: they count, and keep it
RAN_STATES = frozenset({"preparing", "running", "warned", "stopping", "ended"})


@dataclass(frozen=True)
class RuleHistory:
    """first_seen: when gpuresa first saw each key; holding: the keys in `RAN_STATES`;
    used: their bookings, as the journal last saw them, for the periods the rules look at."""

    first_seen: Mapping[str, datetime] = field(default_factory=dict)
    holding: frozenset[str] = frozenset()
    used: tuple[Reservation, ...] = ()


def used_bookings(journal: Journal, config: Config, now: datetime) -> tuple[Reservation, ...]:
    """The bookings that had a session and end in or after the period (of max_gpu_hours)
    that holds the start of the read window; nothing when no rule is set."""
    if not config.rules.active:
        return ()
    zone = ZoneInfo(config.reservations.timezone)
    since, _ = period_of(now - config.reservations.window_past, config.rules.period, zone)
    states = journal.states.all()
    return tuple(
        row
        for row in journal.reservations.all(ending_after=since)
        if states.get(row.key) in RAN_STATES
    )


def rule_history(journal: Journal, config: Config, now: datetime) -> RuleHistory:
    """What the journal at hand says, for a command that reads the calendars as the daemon does."""
    held = frozenset(key for key, state in journal.states.all().items() if state in RAN_STATES)
    return RuleHistory(
        first_seen=journal.reservations.first_seen_times(),
        holding=held,
        used=used_bookings(journal, config, now),
    )
