"""What the planner is given beside the reservations and the sessions.

`Inventory` is the host and its GPUs; `Memory` is what earlier rounds decided
(kept in the journal), so that `plan()` stays a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpuresa.config.sections import Config, HostConfig
from gpuresa.model import SessionSpec


@dataclass(frozen=True)
class Inventory:
    """The host this daemon manages and the GPU indices it can hand out."""

    host: HostConfig
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Memory:
    """What earlier rounds decided and the planner must not forget (kept in the journal).

    missing_since: when a session's reservation was first found missing
        (cancelled, deleted, or never known), which starts its grace period;
    known: keys of every reservation ever seen, to tell a cancelled booking
        (warn the user) from an orphan (nobody to warn);
    warnings_sent: (key, seconds before the end) pairs already sent;
    cancel_notified: keys whose user was already told of the cancellation;
    retry_after: keys whose start failed or could not be served, not to be
        tried again before that time;
    in_flight: keys with an action under way, and the spec a start or prepare
        under way holds (None for other actions): the planner decides nothing
        for them, and what they are taking stays taken;
    stopping: keys (among in_flight) whose stop is under way: their GPUs go to
        the sessions that follow (which start once the stop is done), their
        ports stay taken until the containers are gone;
    refused_ports: ports the engine refused lately (another program listens
        there), skipped when ports are chosen;
    changes_notified: (key, change) pairs whose user was already told that a
        running session keeps what it started with;
    preempt_notified: the stop time each preemptible session was last told of;
    preempted: keys whose preemptible session was stopped for a firm booking:
        done, not started again;
    used: keys whose session saw a login (never released for want of one);
    release_notified: the release time each unused session was told of;
    unused_seen: when the latest check that found no login in a session began
        (a session is released only on a check begun at or after its time);
    up_since: since when each running session lets its user in (its time to be
        used counts from then, or from its booking's start if later);
    released: keys whose session was released for want of a login: done, and
        their bookings hold GPUs no more.
    """

    missing_since: Mapping[str, datetime] = field(default_factory=dict)
    known: frozenset[str] = frozenset()
    warnings_sent: frozenset[tuple[str, int]] = frozenset()
    cancel_notified: frozenset[str] = frozenset()
    retry_after: Mapping[str, datetime] = field(default_factory=dict)
    in_flight: Mapping[str, SessionSpec | None] = field(default_factory=dict)
    stopping: frozenset[str] = frozenset()
    refused_ports: frozenset[int] = frozenset()
    changes_notified: frozenset[tuple[str, str]] = frozenset()
    preempt_notified: Mapping[str, datetime] = field(default_factory=dict)
    preempted: frozenset[str] = frozenset()
    used: frozenset[str] = frozenset()
    release_notified: Mapping[str, datetime] = field(default_factory=dict)
    unused_seen: Mapping[str, datetime] = field(default_factory=dict)
    up_since: Mapping[str, datetime] = field(default_factory=dict)
    released: frozenset[str] = frozenset()

    def missing_deadline(self, key: str, now: datetime, config: Config) -> datetime:
        """When a session whose reservation is gone must stop (after its grace)."""
        since = self.missing_since.get(key, now)
        if key in self.known:
            return since + config.daemon.cancel_grace
        return since + config.daemon.orphan_grace

    def may_try(self, key: str, now: datetime) -> bool:
        """Whether a start or prepare of `key` may be tried (no back-off under way)."""
        retry_after = self.retry_after.get(key)
        return retry_after is None or now >= retry_after
