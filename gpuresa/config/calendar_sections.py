"""[daemon], [reservations] and [[calendars]]: the calendar side of the configuration.

How often the daemon polls, how calendar events become reservations, and each
calendar source; the rest of the file is in `gpuresa.config.sections`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from gpuresa.config.names import NAME, valid_login_values, valid_logins
from gpuresa.config.schema import (
    Field,
    at_least,
    matches,
    positive_duration,
    positive_or_unset,
    valid_regex,
)


def _valid_timezone(value: str) -> str | None:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        return f"unknown time zone {value!r} (use an IANA name such as 'Europe/Paris')"
    return None


def _durations_positive(values: tuple[timedelta, ...]) -> str | None:
    if any(value <= timedelta(0) for value in values):
        return "every warning must be longer than 0s"
    return None


def _room_hosts(values: Mapping[str, str]) -> str | None:
    import re

    bad = [value for value in values.values() if not re.fullmatch(NAME, value)]
    return f"not host names: {', '.join(map(repr, bad))}" if bad else None


def _at_least_a_day(value: timedelta) -> str | None:
    # the journal must remember what the calendars' window still shows
    return None if value >= timedelta(days=1) else "must be at least 1d"


@dataclass(frozen=True)
class DaemonConfig:
    """[daemon]: this machine's role and the service's timing."""

    host: str = Field("localhost", check=matches(NAME, "a host name"))
    state_dir: Path = Path("/var/lib/gpuresa")
    # a booking that starts now is seen within this: an unchanged CalDAV poll is one
    # small sync-token request, GRR's one aggregate query; local ICS files are watched
    poll_interval: timedelta = Field(timedelta(seconds=5), check=positive_duration)
    prepare_ahead: timedelta = timedelta(minutes=5)
    stop_grace: timedelta = timedelta(seconds=30)
    cancel_grace: timedelta = timedelta(minutes=5)
    # a poll that loses most bookings with a session is believed only after this long
    vanish_confirm: timedelta = Field(timedelta(minutes=15), check=positive_duration)
    orphan_grace: timedelta = timedelta(minutes=10)
    warnings: tuple[timedelta, ...] = Field(
        (timedelta(minutes=15), timedelta(minutes=5)), check=_durations_positive
    )
    docker_retry_max: timedelta = Field(timedelta(minutes=1), check=positive_duration)
    journal_retention: timedelta = Field(timedelta(days=180), check=_at_least_a_day)
    # a preemptible session is told this long before it must give its GPUs up (in the
    # session, by e-mail, and with `preempt_signal` to its processes, for a checkpoint)
    preempt_notice: timedelta = Field(timedelta(minutes=10), check=positive_duration)
    # (not SIGINT, SIGHUP or SIGTERM: sshd's login processes and Python catch those, so a
    # warning would close logins and interrupt plain jobs)
    preempt_signal: Literal["SIGUSR1", "SIGUSR2"] = "SIGUSR1"
    # and starts only where it can run this long (or its whole booking)
    preempt_minimum: timedelta = Field(timedelta(minutes=15), check=positive_duration)
    # a session about to be released for want of a login is told this long before (or
    # half its `release_unused`, if shorter)
    release_notice: timedelta = Field(timedelta(minutes=10), check=positive_duration)


@dataclass(frozen=True)
class ReservationsConfig:
    """[reservations]: how calendar events become reservations, site-wide."""

    timezone: str = Field("UTC", check=_valid_timezone)
    window_past: timedelta = timedelta(days=1)
    window_ahead: timedelta = Field(timedelta(days=14), check=positive_duration)
    max_duration: timedelta = Field(timedelta(days=7), check=positive_duration)
    allowed_users: tuple[str, ...] = Field((), check=valid_logins)


@dataclass(frozen=True)
class CalendarConfig:
    """[[calendars]]: one calendar source and the rules that read its events."""

    name: str = Field(check=matches(NAME, "a name of letters, digits, '.', '_' or '-'"))
    url: str = Field(check=matches(r"\S+", "a URL or an absolute path"))
    kind: Literal["caldav", "ics", "grr"] = "caldav"
    username: str | None = None
    password_file: Path | None = None
    password_credential: str | None = None
    auth: Literal["basic", "digest"] = "basic"
    verify_tls: bool = True
    host: str | None = Field(None, check=matches(NAME, "a host name"))
    accept_tentative: bool = False
    user_from: Literal["summary", "organizer", "attendee"] = "summary"
    summary_regex: str | None = Field(None, check=valid_regex)
    email_logins: Mapping[str, str] = Field(factory=dict, check=valid_login_values)
    default_template: str | None = None
    default_cuda: str | None = None
    default_gpus: int = Field(1, check=at_least(1))
    # every booking of this calendar is preemptible (an "idle GPUs" calendar)
    preemptible: bool = False
    # a firm session nobody logged into this long after its start is released (warned
    # `daemon.release_notice` before); unset: the host's `release_unused`, else never
    release_unused: timedelta | None = Field(None, check=positive_or_unset)
    # kind "grr" only (GRR's MySQL/MariaDB database; see gpuresa.reservations.sources.grr)
    unix_socket: Path | None = None
    table_prefix: str = Field("grr_", check=matches(r"[A-Za-z0-9_]{0,32}", "letters, digits, '_'"))
    rooms: Mapping[str, str] = Field(factory=dict, check=_room_hosts)
    # what gpuresa writes back about each booking (`gpuresa.writeback`): "event" into the
    # booking's own event (a caldav calendar, write rights needed), "mirror" into a
    # calendar of its own at mirror_url, "off" nothing. Off by default: gpuresa writes
    # where an admin granted it write rights and asked it to, never on its own
    write_back: Literal["event", "mirror", "off"] = "off"
    mirror_url: str | None = Field(None, check=matches(r"https?://\S+", "an http(s) URL"))
    # the mirror's account; unset: the calendar's own (a caldav calendar's)
    mirror_username: str | None = None
    mirror_password_file: Path | None = None
    mirror_password_credential: str | None = None
    # each write-back request gives up after this (and is tried again later)
    write_timeout: timedelta = Field(timedelta(seconds=10), check=positive_duration)


def write_back_checks(where: str, calendar: CalendarConfig) -> list[str]:
    """Problems of `calendar`'s write-back keys that involve more than one key (`where`:
    its key path, `calendars[INDEX]`)."""
    problems = []
    if calendar.write_back == "event" and calendar.kind != "caldav":
        problems.append(
            f'{where}.write_back: "event" writes into the booking\'s own CalDAV event; a '
            f'{calendar.kind} calendar has none gpuresa may write: use "mirror"'
        )
    if calendar.write_back == "mirror" and calendar.mirror_url is None:
        problems.append(f'{where}.mirror_url: write_back = "mirror" needs the mirror\'s URL')
    if calendar.write_back != "mirror" and calendar.mirror_url is not None:
        problems.append(f'{where}.mirror_url: only with write_back = "mirror"')
    if calendar.mirror_url is not None and (
        calendar.mirror_url.rstrip("/") == calendar.url.rstrip("/")
    ):
        problems.append(
            f"{where}.mirror_url: the mirror cannot be the calendar gpuresa reads "
            "(its events would be read as bookings)"
        )
    if (
        calendar.write_back == "mirror"
        and calendar.kind != "caldav"
        and calendar.mirror_username is None
    ):
        problems.append(
            f"{where}.mirror_username: the mirror's account (a {calendar.kind} "
            "calendar has no CalDAV account to share)"
        )
    if calendar.mirror_username is not None and not (
        calendar.mirror_password_file or calendar.mirror_password_credential
    ):
        problems.append(
            f"{where}.mirror_username: needs mirror_password_file or mirror_password_credential"
        )
    return problems
