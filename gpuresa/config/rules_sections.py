"""[rules]: fair-share limits on bookings, by default, per group and per user.

Every limit is optional: unset at every level, it does not apply, and with no
limit set anywhere the rules cost nothing (`RulesConfig.active`). A group's
table sets the limits of each of its members (not a pool the members share);
a user's table sets that login's exceptions. The string "unlimited" lifts a
limit that a lower level sets (a group or a user freed from the default).
How the levels combine is `gpuresa.fairshare.limits`; what each limit means,
`gpuresa.fairshare.check`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from gpuresa.config.names import valid_login_keys, valid_logins
from gpuresa.config.schema import Field

UNLIMITED = "unlimited"

# the keys every level may set, in the order refusals are checked
LIMIT_KEYS = (
    "max_duration",
    "max_ahead",
    "max_gpus",
    "max_bookings",
    "min_gap",
    "max_gpu_hours",
)


def _not_negative(value: Any) -> str | None:
    if value is None or value == UNLIMITED:
        return None
    zero = timedelta(0) if isinstance(value, timedelta) else 0
    return None if value >= zero else f"must be 0 or more, got {value!r}"


def _positive(value: Any) -> str | None:
    if value is None or value == UNLIMITED:
        return None
    zero = timedelta(0) if isinstance(value, timedelta) else 0
    return None if value > zero else 'must be more than 0 (or "unlimited")'


_COUNT = 'an integer, or "unlimited"'
_DURATION = 'a duration such as "14d", or "unlimited"'


@dataclass(frozen=True)
class RuleLimits:
    """The limits one level sets; None: not set here (the level below decides)."""

    # GPUs one user holds at once, over all hosts
    max_gpus: int | Literal["unlimited"] | None = Field(None, check=_not_negative, expected=_COUNT)
    # GPU-hours (GPUs x hours) one user books per period ([rules] period)
    max_gpu_hours: float | Literal["unlimited"] | None = Field(
        None, check=_not_negative, expected='a number of GPU-hours, or "unlimited"'
    )
    # how far ahead of its start a booking may be, from when gpuresa first saw it
    max_ahead: timedelta | Literal["unlimited"] | None = Field(
        None, check=_positive, expected=_DURATION
    )
    # bookings not yet started one user holds at once
    max_bookings: int | Literal["unlimited"] | None = Field(
        None, check=_not_negative, expected=_COUNT
    )
    # the least time between the end of one of a user's bookings and the start of the next
    min_gap: timedelta | None = Field(None, expected='a duration such as "1h" ("0s": none)')
    # the longest one booking may last
    max_duration: timedelta | Literal["unlimited"] | None = Field(
        None, check=_positive, expected=_DURATION
    )

    def set_here(self) -> dict[str, Any]:
        """The limits this level sets (unset ones left out), by key."""
        return {key: getattr(self, key) for key in LIMIT_KEYS if getattr(self, key) is not None}


@dataclass(frozen=True)
class GroupRules(RuleLimits):
    """[rules.groups.<name>]: the limits of each member of a group, and its members."""

    # logins; with [rules] groups_from = "unix", the host's group of this name adds its own
    members: tuple[str, ...] = Field((), check=valid_logins)


@dataclass(frozen=True)
class RulesConfig(RuleLimits):
    """[rules]: the default limits (its own keys), the period of max_gpu_hours, groups, users."""

    # the period max_gpu_hours counts over, in the site's time zone; weeks start on Monday
    period: Literal["day", "week", "month"] = "week"
    # who is in a group: its `members` list ("config"), or also the host's Unix group of the
    # same name ("unix", read when the calendars are read)
    groups_from: Literal["config", "unix"] = "config"
    groups: Mapping[str, GroupRules] = Field(factory=dict)
    users: Mapping[str, RuleLimits] = Field(factory=dict, check=valid_login_keys)

    @property
    def active(self) -> bool:
        """Whether any level sets any limit (if not, bookings are not looked at)."""
        levels: list[RuleLimits] = [self, *self.groups.values(), *self.users.values()]
        return any(level.set_here() for level in levels)
