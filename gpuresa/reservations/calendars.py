"""Every configured calendar, polled: what the daemon calls each round.

`Calendars.poll(now, first_seen=…, holding=…)` polls each source, reads all
calendars into reservations over the window (`now - window_past` to
`now + window_ahead`), decides over-booking (see
`gpuresa.reservations.conflicts.resolve_conflicts`) and says how fresh each calendar
is. One calendar failing (server down, password refused, file missing) is
logged and read from its last good snapshot; the others go on. A calendar
that never answered and has no snapshot contributes nothing and says so in
its freshness. One object that the source could not fetch or read becomes a
rejection of its own, keyed by its href or file name (no user, no time: it
stops nothing), saying whether its last good copy is used; the rest of its
calendar is read as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from datetime import datetime
from types import MappingProxyType

from gpuresa.config.sections import Config
from gpuresa.fairshare.check import RuleFacts
from gpuresa.fairshare.host_groups import host_members
from gpuresa.model import Rejection, Reservation, ReservationSet, calendar_key
from gpuresa.reservations.claims import Claims
from gpuresa.reservations.rules import read_reservations
from gpuresa.reservations.sources import CalendarSource, SourceError, open_source

log = logging.getLogger(__name__)

_NOTHING_SEEN: Mapping[str, datetime] = MappingProxyType({})


@dataclass(frozen=True)
class CalendarFreshness:
    """How current one calendar's data is."""

    last_success: datetime | None
    # the reason of the last failed poll; None when the last poll succeeded
    last_error: str | None
    # seconds since the last success; None when the calendar was never read
    stale_seconds: float | None


@dataclass(frozen=True)
class CalendarReport:
    """One round: what the calendars ask for, and how fresh each calendar is."""

    reservations: ReservationSet
    freshness: Mapping[str, CalendarFreshness]


def object_rejection(calendar: str, href: str, reason: str, kept: bool) -> Rejection:
    """The rejection of one object that could not be fetched or read (`reason` names it).

    `kept`: whether its last good copy is read instead. Inert: no user to
    tell and no time, so it cancels and stops nothing.
    """
    what = "its last good copy is used" if kept else "nothing in it is booked"
    return Rejection(
        key=calendar_key(href),
        uid="",
        calendar=calendar,
        reason=f"this calendar object cannot be read: {reason}; {what} until it can",
    )


class Calendars:
    """The configured calendars and their sources (snapshots loaded at construction)."""

    def __init__(
        self,
        config: Config,
        *,
        sources: Mapping[str, CalendarSource] | None = None,
        persist: bool = True,
    ) -> None:
        """Open a source per calendar (nothing is fetched yet).

        `sources` replaces the sources made from the config (by calendar name);
        with `persist` false, snapshots are read but never written.
        """
        self.config = config
        self.sources: dict[str, CalendarSource] = dict(sources or {})
        for calendar in config.calendars:
            if calendar.name not in self.sources:
                self.sources[calendar.name] = open_source(
                    calendar,
                    config.daemon.state_dir,
                    persist=persist,
                    reservations=config.reservations,
                )
        self.errors: dict[str, str | None] = {name: None for name in self.sources}

    def poll(
        self,
        now: datetime,
        *,
        first_seen: Mapping[str, datetime] = _NOTHING_SEEN,
        holding: AbstractSet[str] = frozenset(),
        claims: Claims | None = None,
        used: tuple[Reservation, ...] = (),
    ) -> CalendarReport:
        """Poll every calendar, then read them all over the window around `now`.

        `first_seen` (when gpuresa first saw each key: the journal's
        `first_seen_times()`) and `holding` (the keys whose session is
        prepared or running) decide over-booking; `claims`, what the journal
        knows of granted times, ended bookings and where each UID was first
        seen (see `gpuresa.reservations.claims`); `used`, the bookings that had
        a session, which the fair-share rules count (see
        `gpuresa.fairshare.history.used_bookings`). Never raises for a
        calendar's failure: that calendar's last snapshot is used and its
        freshness carries the reason.
        """
        objects: dict[str, Mapping[str, bytes]] = {}
        problems: dict[str, Mapping[str, str]] = {}
        for name, source in self.sources.items():
            try:
                result = source.poll(now)
            except SourceError as error:
                reason = str(error)
                if self.errors.get(name) != reason:
                    log.warning("%s; using its last snapshot", reason)
                self.errors[name] = reason
                objects[name] = source.snapshot()
                continue
            if self.errors.get(name) is not None:
                log.info("calendar %s: reachable again", name)
            self.errors[name] = None
            objects[name] = result.objects
            problems[name] = result.problems
        report = self._report(objects, now, first_seen, holding, claims, used)
        refused = [
            object_rejection(name, href, reason, href in objects[name])
            for name, found in problems.items()
            for href, reason in found.items()
        ]
        if not refused:
            return report
        rejected = sorted((*report.reservations.rejected, *refused), key=lambda item: item.key)
        return replace(report, reservations=replace(report.reservations, rejected=tuple(rejected)))

    def from_snapshots(
        self,
        now: datetime,
        *,
        first_seen: Mapping[str, datetime] = _NOTHING_SEEN,
        holding: AbstractSet[str] = frozenset(),
        claims: Claims | None = None,
        used: tuple[Reservation, ...] = (),
    ) -> CalendarReport:
        """What the snapshots on disk say, without asking any server (for a start-up)."""
        objects = {name: source.snapshot() for name, source in self.sources.items()}
        return self._report(objects, now, first_seen, holding, claims, used)

    def _report(
        self,
        objects: Mapping[str, Mapping[str, bytes]],
        now: datetime,
        first_seen: Mapping[str, datetime],
        holding: AbstractSet[str],
        claims: Claims | None = None,
        used: tuple[Reservation, ...] = (),
    ) -> CalendarReport:
        window = self.config.reservations
        claims = claims or Claims()
        # the host's groups are read here, at the edge, once per reading (when a limit is set)
        rules = self.config.rules
        facts = RuleFacts(now, used, host_members(rules) if rules.active else {})
        found = read_reservations(
            self.config,
            {name: list(items.items()) for name, items in objects.items()},
            now - window.window_past,
            now + window.window_ahead,
            first_seen=first_seen,
            holding=holding,
            granted=claims.granted,
            granted_gpus=claims.granted_gpus,
            ended=claims.ended,
            origins=claims.origins,
            preemptible=claims.preemptible,
            rule_facts=facts,
        )
        freshness = {}
        for name, source in self.sources.items():
            last = source.last_success
            freshness[name] = CalendarFreshness(
                last_success=last,
                last_error=self.errors.get(name),
                stale_seconds=(now - last).total_seconds() if last is not None else None,
            )
        return CalendarReport(found, freshness)
