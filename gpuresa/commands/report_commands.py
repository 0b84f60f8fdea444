"""`gpuresa report`: GPU-hours booked, held and busy, no-shows and refusals over a period.

Dates are read in the site's time zone (`[reservations] timezone`): `--from
2026-11-02` is that day's 00:00 there, `--to 2026-11-08` the end of that day
(a date names whole days, both ends included); a time (`2026-11-02T09:00`)
is that instant. Without `--from`, the report starts on this week's Monday at
00:00; without `--to` it ends now.
"""

from __future__ import annotations

import argparse
import re
from datetime import UTC, date, datetime, timedelta
from typing import cast
from zoneinfo import ZoneInfo

from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.gpus.usage_store import USAGE_FILE
from gpuresa.inert import echo
from gpuresa.reports.formats import as_csv, as_json, as_table
from gpuresa.reports.groups import group_lookup
from gpuresa.reports.reading import JOURNAL_FILE, read_facts
from gpuresa.reports.usage import BY_CHOICES, By, Period, UsageReport, usage_report, week_start

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "report", help="GPU-hours booked, held and busy, no-shows and refusals"
    )
    parser.add_argument(
        "--from",
        dest="start",
        metavar="DATE",
        help="first day (YYYY-MM-DD) or instant, site time (default: this week's Monday)",
    )
    parser.add_argument(
        "--to", dest="end", metavar="DATE", help="last day, included, or instant (default: now)"
    )
    parser.add_argument(
        "--by",
        choices=BY_CHOICES,
        default="user",
        help="one row per user (default), group, host or GPU",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="JSON instead of a table")
    output.add_argument("--csv", action="store_true", help="CSV instead of a table")
    parser.set_defaults(handler=report_command)


def parse_bound(text: str, option: str, zone: ZoneInfo, *, end: bool) -> datetime:
    """A --from/--to value as an aware instant: a date is its day's start (for `end`,
    the next day's start), a naive time is in `zone`. Raises `UserError`."""
    try:
        if _DATE.fullmatch(text):
            day = date.fromisoformat(text) + timedelta(days=1 if end else 0)
            return datetime(day.year, day.month, day.day, tzinfo=zone)
        instant = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(
            f"{option}: expected a date such as 2026-11-02 or a time such as "
            f"2026-11-02T09:00 (in {zone}), got {text!r}"
        ) from None
    return instant if instant.tzinfo else instant.replace(tzinfo=zone)


def report_period(start: str | None, end: str | None, zone: ZoneInfo, now: datetime) -> Period:
    """The period `--from start --to end` names at `now` (see the module docstring).

    Raises `UserError` for a bad date or a period that ends before it starts.
    """
    first = (
        parse_bound(start, "--from", zone, end=False) if start else week_start(now.astimezone(zone))
    )
    last = parse_bound(end, "--to", zone, end=True) if end else now
    if last <= first:
        shown = "%Y-%m-%d %H:%M"
        raise UserError(
            f"--from/--to: the period must end after it starts "
            f"({first.astimezone(zone).strftime(shown)} is not before "
            f"{last.astimezone(zone).strftime(shown)} in {zone})"
        )
    return Period(first.astimezone(UTC), last.astimezone(UTC))


def build_report(config: Config, period: Period, by: By, now: datetime) -> UsageReport:
    """The report of this daemon's host over `period`, read from its journal and usage store."""
    facts = read_facts(
        config.daemon.state_dir / JOURNAL_FILE,
        config.daemon.state_dir / USAGE_FILE,
        period,
        config.daemon.host,
        {calendar.name: calendar.host for calendar in config.calendars},
    )
    return usage_report(facts, period, by, group_lookup(config), now)


def report_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    zone = ZoneInfo(config.reservations.timezone)
    now = datetime.now(UTC)
    period = report_period(arguments.start, arguments.end, zone, now)
    report = build_report(config, period, cast(By, arguments.by), now)
    if arguments.json:
        text = as_json(report)
    elif arguments.csv:
        text = as_csv(report)
    else:
        text = as_table(report, zone)
    for line in text.rstrip("\n").split("\n"):
        echo(line)
    return 0
