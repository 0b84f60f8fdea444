"""Which limits apply to one user: their exceptions, else their groups', else the default.

Pure. For each limit on its own: a value the user's own table sets wins;
else, for a user in groups, the most generous of their groups' values (a
group that leaves a limit unset has the default's), since being in one more
group should never take away what another group gives; else the default.
"Unlimited" (or unset at every level) means the limit does not apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType

from gpuresa.config.rules_sections import LIMIT_KEYS, UNLIMITED, RulesConfig

# a limit's value: a count, GPU-hours or a duration
Amount = int | float | timedelta

NO_MEMBERS: Mapping[str, AbstractSet[str]] = MappingProxyType({})


@dataclass(frozen=True)
class Limit:
    """One limit that applies to a user, and the level that set it ("group students")."""

    value: Amount
    source: str


def groups_of(
    user: str, rules: RulesConfig, host_members: Mapping[str, AbstractSet[str]] = NO_MEMBERS
) -> tuple[str, ...]:
    """The configured groups `user` is in, by name: listed in `members`, or (with
    groups_from = "unix") a member of the host's group of that name (`host_members`,
    read at the edge: `gpuresa.fairshare.host_groups`)."""
    from_host = rules.groups_from == "unix"
    return tuple(
        sorted(
            name
            for name, group in rules.groups.items()
            if user in group.members or (from_host and user in host_members.get(name, ()))
        )
    )


def limits_for(
    user: str, rules: RulesConfig, host_members: Mapping[str, AbstractSet[str]] = NO_MEMBERS
) -> dict[str, Limit]:
    """The limits that apply to `user`, by key (those that do not apply left out)."""
    own = rules.users.get(user)
    own_values = own.set_here() if own is not None else {}
    groups = groups_of(user, rules, host_members)
    found: dict[str, Limit] = {}
    for key in LIMIT_KEYS:
        if key in own_values:
            chosen: Limit | None = _limit(own_values[key], f"user {user}")
        elif groups:
            chosen = _most_generous(key, [_group_limit(rules, name, key) for name in groups])
        else:
            chosen = _limit(rules.set_here().get(key), "default")
        if chosen is not None:
            found[key] = chosen
    return found


def _group_limit(rules: RulesConfig, name: str, key: str) -> Limit | None:
    """Group `name`'s limit `key`: its own, else the default's (named so in refusals)."""
    own = rules.groups[name].set_here()
    if key in own:
        return _limit(own[key], f"group {name}")
    return _limit(rules.set_here().get(key), "default")


def _limit(value: object, source: str) -> Limit | None:
    """The limit `value` sets (None: unset or "unlimited", no limit)."""
    if value is None or value == UNLIMITED:
        return None
    assert isinstance(value, (int, float, timedelta))
    return Limit(value, source)


def _most_generous(key: str, candidates: list[Limit | None]) -> Limit | None:
    """The most generous of the groups' limits: none at all if one group sets none; the
    shortest min_gap; the largest of the others. The first group by name wins a tie."""
    if any(candidate is None for candidate in candidates):
        return None
    limits = [candidate for candidate in candidates if candidate is not None]
    if key == "min_gap":
        return min(limits, key=lambda limit: limit.value)
    return max(limits, key=lambda limit: limit.value)
