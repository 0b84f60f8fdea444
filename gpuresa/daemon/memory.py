"""What the loop keeps between rounds, mirrored in the journal where a restart needs it.

Only the loop thread changes it. What a restart must not forget is written
to the journal's `meta` table before the action it guards is dispatched: the
grace period of a vanished booking (`missing:<key>`), each warning shown in
a session (`warned:<seconds>:<key>`) and each cancel notice
(`cancel-notified:<key>`). So a restarted daemon repeats no message inside a
session: at most once there, at least once by e-mail (the outbox).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpuresa.config.sections import Config
from gpuresa.daemon.executor import InFlight
from gpuresa.journal.store import Journal
from gpuresa.model import Reservation, Session, SessionSpec
from gpuresa.planning.actions import Stop
from gpuresa.planning.facts import Memory

# The journal's note of a preemptible session told it must stop (`preempt-notified:<key>`).
PREEMPT_NOTIFIED = "preempt-notified:"
# ... and of a booking whose preemptible session was stopped for a firm one (`preempted:<key>`):
# done for good, whatever its state says later (a rejection, a booking again)
PREEMPTED = "preempted:"
# A failed start or stop is retried after these delays (then every last one).
RETRY_DELAYS = (timedelta(seconds=15), timedelta(seconds=60), timedelta(minutes=5))


@dataclass
class Remembered:
    """The loop's memory; `memory()` turns it into the planner's `Memory`."""

    missing_since: dict[str, datetime] = field(default_factory=dict)
    warnings_sent: set[tuple[str, int]] = field(default_factory=set)
    cancel_notified: set[str] = field(default_factory=set)
    retry_after: dict[str, datetime] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    refused_ports: dict[int, datetime] = field(default_factory=dict)
    changes_notified: set[tuple[str, str]] = field(default_factory=set)
    # stops a restart cut short, whose finishing failed: (attempts, not before)
    finishing: dict[str, tuple[int, datetime]] = field(default_factory=dict)
    # (key, ssh port, FTP password) of start notices already handed to the outbox
    start_noticed: set[tuple[str, int, str]] = field(default_factory=set)
    # the stop time each preemptible session was told it must give its GPUs up at
    preempt_notified: dict[str, datetime] = field(default_factory=dict)

    @classmethod
    def load(cls, journal: Journal) -> Remembered:
        """What the journal kept of an earlier run (grace periods, messages shown)."""
        remembered = cls()
        for key, value in journal.facts.with_prefix("missing:").items():
            if value:
                remembered.missing_since[key] = datetime.fromisoformat(value)
        for name in journal.facts.with_prefix("warned:"):
            seconds, _, key = name.partition(":")
            if seconds.isdigit() and key:
                remembered.warnings_sent.add((key, int(seconds)))
        remembered.cancel_notified.update(journal.facts.with_prefix("cancel-notified:"))
        for key, value in journal.facts.with_prefix(PREEMPT_NOTIFIED).items():
            with contextlib.suppress(ValueError):
                remembered.preempt_notified[key] = datetime.fromisoformat(value)
        return remembered

    def memory(
        self,
        reservations: Iterable[Reservation],
        sessions: Iterable[Session],
        in_flight: Mapping[str, InFlight],
        now: datetime,
        journal: Journal,
    ) -> Memory:
        """The planner's view: grace periods started, messages sent, what is under way."""
        wanted = {reservation.key for reservation in reservations}
        present = {session.key for session in sessions}
        for key in present - wanted - set(self.missing_since):
            self.missing_since[key] = now
            journal.facts.set(f"missing:{key}", now.isoformat())
        for key in list(self.missing_since):
            if key in wanted or key not in present:
                del self.missing_since[key]
                journal.facts.delete(f"missing:{key}")
        for key in self.cancel_notified & wanted:
            # the booking came back: a later cancellation gets its own notice
            self.cancel_notified.discard(key)
            journal.facts.delete(f"cancel-notified:{key}")
        for port, until in list(self.refused_ports.items()):
            if now >= until:
                del self.refused_ports[port]
        # what is kept about bookings that are gone (no reservation, no session, nothing
        # under way) goes too: the daemon runs for months
        gone = (set(self.retry_after) | set(self.attempts)) - wanted - present - set(in_flight)
        for key in gone:
            if now >= self.retry_after.get(key, now):
                self.retry_after.pop(key, None)
                self.attempts.pop(key, None)
        self.changes_notified = {item for item in self.changes_notified if item[0] in present}
        self.start_noticed = {item for item in self.start_noticed if item[0] in present}
        busy = set(in_flight)
        for sent_key, seconds in list(self.warnings_sent):
            if sent_key not in present and sent_key not in busy and sent_key not in wanted:
                self.warnings_sent.discard((sent_key, seconds))
                journal.facts.delete(f"warned:{seconds}:{sent_key}")
        for key in self.cancel_notified - present - busy - wanted:
            self.cancel_notified.discard(key)
            journal.facts.delete(f"cancel-notified:{key}")
        for key in set(self.preempt_notified) - present - busy:
            del self.preempt_notified[key]
            journal.facts.delete(PREEMPT_NOTIFIED + key)
        states = journal.states.all()
        # a preempted booking stays done while the calendars show it; then its note goes
        preempted = set(journal.facts.with_prefix(PREEMPTED))
        for key in preempted - wanted - present:
            preempted.discard(key)
            journal.facts.delete(PREEMPTED + key)
        specs: dict[str, SessionSpec | None] = {
            key: entry.payload if isinstance(entry.payload, SessionSpec) else None
            for key, entry in in_flight.items()
        }
        stopping = frozenset(
            key for key, entry in in_flight.items() if isinstance(entry.payload, Stop)
        )
        return Memory(
            missing_since=dict(self.missing_since),
            known=frozenset(states) | frozenset(wanted),
            warnings_sent=frozenset(self.warnings_sent),
            cancel_notified=frozenset(self.cancel_notified),
            retry_after=dict(self.retry_after),
            in_flight=specs,
            stopping=stopping,
            refused_ports=frozenset(self.refused_ports),
            changes_notified=frozenset(self.changes_notified),
            preempt_notified=dict(self.preempt_notified),
            preempted=frozenset(preempted),
        )

    # --- what the loop records as it dispatches -------------------------------------------

    def warned(
        self, key: str, before: timedelta, config: Config, journal: Journal, now: datetime
    ) -> None:
        """A warning is being shown: it and the larger thresholds are never shown again."""
        for warning in config.daemon.warnings:
            if warning >= before:
                seconds = int(warning.total_seconds())
                self.warnings_sent.add((key, seconds))
                journal.facts.set(f"warned:{seconds}:{key}", now.isoformat())

    def extended(
        self, key: str, end: datetime, now: datetime, config: Config, journal: Journal
    ) -> None:
        """A new end: the warnings whose time is now in the future are due again."""
        for sent_key, seconds in list(self.warnings_sent):
            if sent_key == key and end - timedelta(seconds=seconds) > now:
                self.warnings_sent.discard((sent_key, seconds))
                journal.facts.delete(f"warned:{seconds}:{key}")

    def preempt_noticed(self, key: str, stop_at: datetime, journal: Journal) -> None:
        self.preempt_notified[key] = stop_at
        journal.facts.set(PREEMPT_NOTIFIED + key, stop_at.isoformat())

    def cancel_noticed(self, key: str, journal: Journal, now: datetime) -> None:
        self.cancel_notified.add(key)
        journal.facts.set(f"cancel-notified:{key}", now.isoformat())

    def back_off(self, key: str, now: datetime) -> int:
        """Count one more failed attempt and delay the next; returns the attempt number."""
        attempts = self.attempts.get(key, 0) + 1
        self.attempts[key] = attempts
        self.retry_after[key] = now + RETRY_DELAYS[min(attempts, len(RETRY_DELAYS)) - 1]
        return attempts

    def started(self, key: str) -> None:
        self.attempts.pop(key, None)
        self.retry_after.pop(key, None)

    def stopped(self, key: str, journal: Journal) -> None:
        """A session is gone: what was kept about it goes too."""
        self.attempts.pop(key, None)
        self.retry_after.pop(key, None)
        self.missing_since.pop(key, None)
        for sent_key, seconds in list(self.warnings_sent):
            if sent_key == key:
                self.warnings_sent.discard((sent_key, seconds))
                journal.facts.delete(f"warned:{seconds}:{key}")
        self.start_noticed = {item for item in self.start_noticed if item[0] != key}
