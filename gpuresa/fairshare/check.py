"""Fair-share rules, applied: the bookings that break a user's limits, each refused alone.

Pure: the clock (`RuleFacts.now`), the journal's knowledge and the host's
groups come in as values. Applied after the calendars are read and before
over-booking is decided, so a refused booking takes no GPU from anyone.

Each user's bookings are weighed one at a time, in the order that decides
which of them a limit refuses: those that hold a session first (they are
never refused afterwards, and count), then by when gpuresa first saw each
(a key never seen counts as seen now), then by start, then by key. Never by
UID, CREATED or calendar order: whoever writes the event writes those. A
refused booking counts for nothing, so it never makes another one refused.
The bookings that had a session and are no longer read from the calendars
(`RuleFacts.used`, from the journal) count before all of them.

What each limit refuses (its figures are in the reason):

- max_duration: a booking longer than the limit;
- max_ahead: a booking that starts further ahead of when gpuresa first saw
  it than the limit; measured from the first sight, not from now, so a
  refusal never turns into an acceptance as time passes;
- max_gpus: a booking that would make the user hold more GPUs at once
  (over all hosts) than the limit;
- max_bookings: a booking not yet started when the user already has that
  many bookings still to come;
- min_gap: a booking that starts less than the limit after another of the
  user's ends, or ends less than the limit before one starts (overlapping
  ones included);
- max_gpu_hours: a booking that would take the user's GPU-hours (GPUs x
  hours) in a period of the site's calendar past the limit; a booking that
  crosses a period's end counts in each period for its part there.

Preemptible bookings claim nothing (see
`gpuresa.reservations.conflicts.resolve_conflicts`): no limit refuses them and
they count for none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from types import MappingProxyType

from gpuresa.config.rules_sections import LIMIT_KEYS, RulesConfig
from gpuresa.fairshare.ledger import Booking, decide_user
from gpuresa.fairshare.limits import limits_for
from gpuresa.model import Rejection, Reservation

log = logging.getLogger(__name__)

_NOTHING_SEEN: Mapping[str, datetime] = MappingProxyType({})
# how every refusal of a rule begins: "rule max_gpus (group students): ..."
_RULE_OPENINGS = tuple(f"rule {key} (" for key in LIMIT_KEYS)


@dataclass(frozen=True)
class RuleFacts:
    """What the rules need beside the bookings, as plain values from the edge.

    now: the time of the reading (bookings not yet started are "to come";
    a key never seen is seen now); used: the bookings that had a session
    (prepared, running or ended: the journal's), counted when the calendars
    no longer list them; host_members: the host's Unix groups by name (their
    logins), for [rules] groups_from = "unix".
    """

    now: datetime
    used: tuple[Reservation, ...] = ()
    host_members: Mapping[str, AbstractSet[str]] = field(default_factory=dict)


def apply_rules(
    reservations: Sequence[Reservation],
    rules: RulesConfig,
    facts: RuleFacts,
    zone: tzinfo,
    *,
    first_seen: Mapping[str, datetime] = _NOTHING_SEEN,
    holding: AbstractSet[str] = frozenset(),
    preemptible: AbstractSet[str] = frozenset(),
) -> tuple[list[Reservation], list[Rejection]]:
    """The reservations that keep to their users' limits (in their given order), and a
    rejection naming the rule and its figures for each other one.

    `first_seen`: when gpuresa first saw each key (the journal's); `holding`: the
    keys whose session is prepared, running or ended, never refused;
    `preemptible`: the keys ever seen preemptible; `zone`: the site's time zone
    (periods and the times in reasons). With no limit configured, returns the
    reservations as they are.
    """
    if not rules.active:
        return list(reservations), []
    now = facts.now
    mine: dict[str, list[Booking]] = {}
    for item in reservations:
        if item.preemptible or item.key in preemptible:
            continue
        seen = first_seen.get(item.key, now)
        booking = Booking(
            item.key not in holding,
            seen,
            item.start,
            item.key,
            item.end,
            item.gpus,
            item.start > now,
        )
        mine.setdefault(item.user, []).append(booking)
    listed = {item.key for item in reservations}
    counted: dict[str, list[Booking]] = {}
    for item in facts.used:
        if item.key in listed or item.preemptible or item.key in preemptible:
            continue
        booking = Booking(
            False, item.start, item.start, item.key, item.end, item.gpus, item.start > now
        )
        counted.setdefault(item.user, []).append(booking)
    refused: dict[str, str] = {}
    for user, bookings in mine.items():
        limits = limits_for(user, rules, facts.host_members)
        if not limits:
            continue
        decided = decide_user(
            user,
            tuple(sorted(bookings)),
            tuple(counted.get(user, ())),
            tuple(limits.items()),
            rules.period,
            zone,
        )
        for key, reason in decided:
            log.debug("%s: refused by a fair-share rule: %s", key, reason)
            refused[key] = reason
    rejections = [
        Rejection.of(item, refused[item.key]) for item in reservations if item.key in refused
    ]
    return [item for item in reservations if item.key not in refused], rejections


def is_rule_refusal(rejection: Rejection) -> bool:
    """Whether `rejection` is a fair-share rule's (its reason starts "rule <limit> (")."""
    return rejection.reason.startswith(_RULE_OPENINGS)
