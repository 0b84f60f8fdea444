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
# A session seen used (a login), which is never released for want of one (`used:<key>`); a
# session told it will be released (`release-notified:<key>`: when); and a booking whose
# session was released (`released:<key>`): done for good, like a preempted one.
USED = "used:"
RELEASE_NOTIFIED = "release-notified:"
RELEASED = "released:"
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
    # sessions a login was seen in, and the release time each unused one was told of
    used: set[str] = field(default_factory=set)
    release_notified: dict[str, datetime] = field(default_factory=dict)
    # when the latest check that found no login in a session began (`daemon.logins`)
    unused_seen: dict[str, datetime] = field(default_factory=dict)
    # since when each running session lets its user in (its wait for a login starts then)
    up_since: dict[str, datetime] = field(default_factory=dict)

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
        remembered.used.update(journal.facts.with_prefix(USED))
        for key, value in journal.facts.with_prefix(RELEASE_NOTIFIED).items():
            with contextlib.suppress(ValueError):
                remembered.release_notified[key] = datetime.fromisoformat(value)
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
        for key in set(self.release_notified) - present - busy:
            del self.release_notified[key]
            journal.facts.delete(RELEASE_NOTIFIED + key)
        for key in set(self.unused_seen) - present:
            del self.unused_seen[key]
        running = {session.key for session in sessions if session.state == "running"}
        for key in running - set(self.up_since):
            # the journal's time of its start, or (adopted after a restart in another
            # state) now: never earlier than its user could log in
            since = journal.states.since(key) if journal.states.get(key) == "running" else None
            self.up_since[key] = since or now
        for key in set(self.up_since) - running:
            del self.up_since[key]
        for key in self.used - present - busy - wanted:
            self.used.discard(key)
            journal.facts.delete(USED + key)
        states = journal.states.all()
        # a preempted or released booking stays done while the journal keeps its state (a
        # booking gone from the calendars for a while, then back, is still done); its note
        # goes when the journal trims the booking
        kept = wanted | present | set(states)
        preempted = _done_for_good(journal, PREEMPTED, kept)
        released = _done_for_good(journal, RELEASED, kept)
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
            used=frozenset(self.used),
            release_notified=dict(self.release_notified),
            unused_seen=dict(self.unused_seen),
            up_since=dict(self.up_since),
            released=frozenset(released),
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

    def release_noticed(self, key: str, release_at: datetime, journal: Journal) -> None:
        self.release_notified[key] = release_at
        journal.facts.set(RELEASE_NOTIFIED + key, release_at.isoformat())

    def seen_used(self, key: str, journal: Journal, now: datetime) -> None:
        """A login was seen in `key`'s session: it is never released for want of one."""
        if key not in self.used:
            self.used.add(key)
            journal.facts.set(USED + key, now.isoformat())

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


def _done_for_good(journal: Journal, prefix: str, shown: set[str]) -> set[str]:
    """The keys of the journal's `prefix` facts; those neither wanted nor present lose it."""
    keys = set(journal.facts.with_prefix(prefix))
    for key in keys - shown:
        keys.discard(key)
        journal.facts.delete(prefix + key)
    return keys
