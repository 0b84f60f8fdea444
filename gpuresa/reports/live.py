"""The daemon's usage figures: this week's table for the status page, counters for Prometheus.

`UsageWatch.refresh(now, …)` reads the journal and the usage store (once per
`EVERY`, see `due`; the daemon runs it off its loop, since looking up groups
may wait on the host's directory) and returns a `UsageView`: the week's report by user, and
GPU-seconds booked and used counted since the daemon started.

The counters grow by slices: each refresh adds what the slice [last refresh,
now) booked and used, so they only grow (a Prometheus counter must) and each
costs a read of one minute's rows. They start at 0 when the daemon starts;
Prometheus' `rate` and `increase` take such resets in their stride. Used
seconds are busy seconds (held × mean utilization, see
`gpuresa.reports.usage`), taken with the mean known at each slice.

Labels, with cardinality in mind: booked seconds carry `group` and `user`
(the site's logins, `known_login`: tens to a few hundred, one series each,
since each login counts for one group, see `gpuresa.reports.groups`; any
other name a calendar gives counts as "(other)"); used seconds carry
`group` only (a panel of use against bookings sums by group; per login, the
report has it). Never a booking's key or a GPU: one series per booking would
grow without end.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.reports.groups import group_lookup
from gpuresa.reports.reading import read_facts
from gpuresa.reports.usage import HOUR, Period, UsageReport, usage_report, week_start

log = logging.getLogger(__name__)

# how often the figures are read again: the page shows GPU-hours, a minute is fine
EVERY = timedelta(minutes=1)
# the `user` label of logins the site does not know: a calendar writer can name any number
# of logins, and each would be a series of its own
OTHER_LOGINS = "(other)"


def known_login(login: str, config: Config) -> bool:
    """Whether the site knows `login`: a key in `users.keys_dir`, or a uid or an e-mail
    address in `[users]`."""
    users = config.users
    if login in users.uids or login in users.emails:
        return True
    return "/" not in login and (users.keys_dir / f"{login}.pub").is_file()


@dataclass(frozen=True)
class UsageView:
    """This week's report by user, and the counters since the daemon started (seconds)."""

    week: UsageReport | None = None
    booked_seconds: Mapping[tuple[str, str], float] = field(default_factory=dict)
    used_seconds: Mapping[str, float] = field(default_factory=dict)


@dataclass
class UsageWatch:
    """Reads the figures every `EVERY` (see the module docstring).

    `journal_file`, `usage_file`: the daemon's files; `started`: when the
    counters begin (the daemon's start).
    """

    journal_file: Path
    usage_file: Path
    started: datetime
    _counted_to: datetime | None = None
    _tried_at: datetime | None = None
    _booked: dict[tuple[str, str], float] = field(default_factory=dict)
    _used: dict[str, float] = field(default_factory=dict)
    _view: UsageView = field(default_factory=UsageView)

    @property
    def view(self) -> UsageView:
        return self._view

    def due(self, now: datetime) -> bool:
        """Whether the figures are older than `EVERY` at `now` (pure)."""
        return self._tried_at is None or not timedelta(0) <= now - self._tried_at < EVERY

    def refresh(self, now: datetime, config: Config) -> UsageView:
        """Read the figures of `config`'s host again when due; the latest view (the last one
        when reading fails, which is logged)."""
        if not self.due(now):
            return self._view
        self._tried_at = now
        host = config.daemon.host
        zone = ZoneInfo(config.reservations.timezone)
        group_of = group_lookup(config)
        calendar_hosts = {calendar.name: calendar.host for calendar in config.calendars}
        counted_to = self._counted_to or self.started
        monday = week_start(now.astimezone(zone))
        week = Period(monday, max(now, monday + timedelta(seconds=1)))
        # the clock went back: nothing is counted until it passes the last count again
        facts_period = week if now <= counted_to else Period(min(week.start, counted_to), now)
        try:
            facts = read_facts(
                self.journal_file, self.usage_file, facts_period, host, calendar_hosts
            )
        except UserError as error:
            # tried: again in a minute, and the slice then counts this minute too
            log.warning("usage figures not read: %s", error)
            return self._view
        if now > counted_to:
            slice_report = usage_report(facts, Period(counted_to, now), "user", group_of, now)
            for row in slice_report.rows:
                group = group_of(row.key)
                key = (group, row.key if known_login(row.key, config) else OTHER_LOGINS)
                self._booked[key] = self._booked.get(key, 0.0) + row.booked * HOUR
                self._used[group] = self._used.get(group, 0.0) + row.busy * HOUR
            self._counted_to = now
        self._view = UsageView(
            usage_report(facts, week, "user", group_of, now), dict(self._booked), dict(self._used)
        )
        return self._view
