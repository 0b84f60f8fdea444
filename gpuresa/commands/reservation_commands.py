"""`gpuresa reservations`: what gpuresa makes of the calendars (or of an ICS export)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.fairshare.check import RuleFacts
from gpuresa.fairshare.history import RuleHistory, rule_history
from gpuresa.fairshare.host_groups import host_members
from gpuresa.inert import echo, inert
from gpuresa.model import Rejection, Reservation, ReservationSet
from gpuresa.reservations.conflicts import site_time
from gpuresa.reservations.rules import read_reservations
from gpuresa.reservations.sources import SourceError, open_source

# the RECURRENCE-ID that ends the key of an occurrence of a series (`model.occurrence_key`)
_OCCURRENCE_STAMP = re.compile(r"@[0-9]{8}(?:T[0-9]{6}Z?)?(?=/growth$|$)")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "reservations",
        help="list the reservations the calendars ask for, and the rejected bookings",
        description=(
            "Read the calendars (or an ICS file) and list the reservations that overlap "
            "the window, then the rejected bookings with their reasons."
        ),
    )
    parser.add_argument(
        "--from",
        dest="window_from",
        metavar="ISO",
        help="start of the window, such as 2026-03-01 or 2026-03-01T09:00 (default: now; "
        "without an offset, in the site's time zone)",
    )
    parser.add_argument(
        "--to",
        dest="window_to",
        metavar="ISO",
        help="end of the window (default: the start plus reservations.window_ahead)",
    )
    parser.add_argument(
        "--calendar", metavar="NAME", help="only this calendar (its mapping rules for --ics)"
    )
    parser.add_argument(
        "--ics",
        metavar="FILE",
        help="read this .ics file (or folder) instead of the calendar's source, with the "
        "mapping rules of --calendar (or of the only calendar)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=reservations_command)


def reservations_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    zone = ZoneInfo(config.reservations.timezone)
    window_start = (
        parse_moment(arguments.window_from, zone, "--from")
        if arguments.window_from
        else datetime.now(UTC).replace(microsecond=0)
    )
    window_end = (
        parse_moment(arguments.window_to, zone, "--to")
        if arguments.window_to
        else window_start + config.reservations.window_ahead
    )
    if window_end <= window_start:
        raise UserError("--to must be later than --from")
    if arguments.ics:
        calendar = _calendar_for_file(config, arguments.calendar, Path(arguments.ics))
        config = replace(config, calendars=(calendar,))
        objects = {calendar.name: _read_file(calendar)}
    else:
        calendars = (
            (config.calendar(arguments.calendar),) if arguments.calendar else config.calendars
        )
        if not calendars:
            raise UserError(
                f"{config.source} lists no [[calendars]]; add one, or read a file with --ics FILE"
            )
        window = (window_start, window_end)
        objects = {calendar.name: _read_source(config, calendar, window) for calendar in calendars}
    now = datetime.now(UTC)
    history = _rule_history(config, now)
    found = read_reservations(
        config,
        {name: list(items.items()) for name, items in objects.items()},
        window_start,
        window_end,
        first_seen=history.first_seen,
        holding=history.holding,
        rule_facts=RuleFacts(
            now, history.used, host_members(config.rules) if config.rules.active else {}
        ),
    )
    if arguments.json:
        print(json.dumps(as_json(found), indent=2))
    else:
        print_table(found, zone, window_start, window_end)
    return 0


def _rule_history(config: Config, now: datetime) -> RuleHistory:
    """What the daemon's journal says, for the fair-share rules (which weigh bookings by
    when the daemon first saw them); nothing when no rule is set or no journal is kept."""
    from gpuresa.daemon import journal_path
    from gpuresa.journal.store import Journal

    if not config.rules.active or not journal_path(config).exists():
        return RuleHistory()
    journal = Journal(journal_path(config), read_only=True)
    try:
        return rule_history(journal, config, now)
    finally:
        journal.close()


def parse_moment(text: str, zone: ZoneInfo, option: str) -> datetime:
    """An ISO 8601 date or date-time as aware UTC; without an offset, in `zone`."""
    try:
        if len(text.strip()) == 10:
            moment = datetime.combine(date.fromisoformat(text.strip()), time())
        else:
            moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UserError(
            f"{option} {text!r} is not an ISO 8601 date or time (such as 2026-03-01 or "
            "2026-03-01T09:00+01:00)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=zone)
    return moment.astimezone(UTC)


def _calendar_for_file(config: Config, name: str | None, path: Path) -> CalendarConfig:
    """The calendar whose mapping rules read `path`: --calendar, else the only one."""
    path = path.absolute()
    if not path.exists():
        raise UserError(f"--ics {path}: no such file or folder")
    if name is not None:
        rules = config.calendar(name)
    elif len(config.calendars) == 1:
        rules = config.calendars[0]
    elif not config.calendars:
        # no calendar configured: the default rules
        return CalendarConfig(name="file", url=str(path), kind="ics")
    else:
        known = ", ".join(calendar.name for calendar in config.calendars)
        raise UserError(f"--ics: say whose mapping rules apply with --calendar NAME ({known})")
    return replace(rules, url=str(path), kind="ics")


def _read_file(calendar: CalendarConfig) -> dict[str, bytes]:
    source = open_source(calendar, None, persist=False)
    try:
        return dict(source.poll().objects)
    except SourceError as error:
        raise UserError(str(error)) from None


def _read_source(
    config: Config, calendar: CalendarConfig, window: tuple[datetime, datetime]
) -> dict[str, bytes]:
    """A calendar's objects, fresh from its source, else from the daemon's last snapshot.

    A database (GRR) is read over `window` only.
    """
    source = open_source(calendar, config.daemon.state_dir, persist=False, window=window)
    try:
        return dict(source.poll().objects)
    except SourceError as error:
        snapshot = source.snapshot()
        if not snapshot:
            raise UserError(f"{error} (and no snapshot of it is kept yet)") from None
        when = source.last_success.isoformat() if source.last_success else "an unknown time"
        print(inert(f"gpuresa: {error}; showing its last snapshot (from {when})"), file=sys.stderr)
        return dict(snapshot)


def as_json(found: ReservationSet) -> dict[str, list[dict[str, Any]]]:
    """The public JSON form: {"reservations": [...], "rejected": [...]}; keep the names."""
    return {
        "reservations": [_reservation_json(reservation) for reservation in found.reservations],
        "rejected": [_rejection_json(rejection) for rejection in found.rejected],
    }


def _reservation_json(reservation: Reservation) -> dict[str, Any]:
    return {
        "key": reservation.key,
        "uid": reservation.uid,
        # no UID in the event: "uid" is derived from its content (stable while it is unchanged)
        "uid_derived": reservation.uid_derived,
        "recurrence_id": reservation.recurrence_id,
        "calendar": reservation.calendar,
        "host": reservation.host,
        "user": reservation.user,
        "template": reservation.template,
        "cuda": reservation.cuda,
        "gpus": reservation.gpus,
        "start": reservation.start.astimezone(UTC).isoformat(),
        "end": reservation.end.astimezone(UTC).isoformat(),
    }


def _rejection_json(rejection: Rejection) -> dict[str, Any]:
    return {
        "key": rejection.key,
        "uid": rejection.uid,
        "uid_derived": rejection.uid_derived,
        "calendar": rejection.calendar,
        "reason": rejection.reason,
    }


def print_table(
    found: ReservationSet, zone: ZoneInfo, window_start: datetime, window_end: datetime
) -> None:
    """The reservations as a table (times in the site zone), then the rejections."""

    def shown(moment: datetime) -> str:
        return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M")

    echo(
        f"Reservations from {shown(window_start)} to {shown(window_end)} ({zone.key}): "
        f"{len(found.reservations)}"
    )
    if found.reservations:
        rows = [("START", "END", "HOST", "USER", "GPUS", "TEMPLATE", "CUDA", "KEY")]
        rows += [
            (
                shown(reservation.start),
                shown(reservation.end),
                reservation.host,
                reservation.user,
                str(reservation.gpus),
                reservation.template,
                reservation.cuda or "-",
                reservation.key,
            )
            for reservation in found.reservations
        ]
        # cells made inert before they are measured, so the columns stay aligned
        shown_rows = [[inert(cell) for cell in row] for row in rows]
        widths = [max(len(row[column]) for row in shown_rows) for column in range(len(rows[0]) - 1)]
        for row in shown_rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            echo("  " + "  ".join([*cells, row[-1]]))
    echo(f"\nRejected: {len(found.rejected)}")
    for rejection in found.rejected:
        # one form of time on the line: the site's, with its zone; the occurrence's
        # RECURRENCE-ID (a UTC stamp in its key, kept in --json) is what `when` says
        when = f"{site_time(rejection.start, zone)} " if rejection.start is not None else ""
        booking = _OCCURRENCE_STAMP.sub(", one occurrence", rejection.key, count=1)
        echo(f"  {when}{booking} ({rejection.calendar}): {rejection.reason}")
