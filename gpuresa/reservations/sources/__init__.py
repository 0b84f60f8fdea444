"""Calendar sources: where calendar objects come from (CalDAV or ICS), one gateway each.

A source's `poll()` returns every object of its calendar (href or file name ->
iCalendar bytes), says whether anything changed since the last poll, and
counts the requests and bytes it took. Each source keeps its last good
snapshot under `<state_dir>/calendars/<name>/`, loaded when it is made, so a
restarted daemon has its reservations before (or without) the server; a
failure of the whole calendar (no answer, a refused login, a missing folder)
raises `SourceError` with a one-line reason and leaves the snapshot as it
was. One object that cannot be fetched or read (a file of a folder, an href
of a collection) fails alone: it is named in `PollResult.problems`, its last
good copy (if any) stays, and the rest of the calendar is read as usual.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from gpuresa.config.calendar_sections import CalendarConfig, ReservationsConfig
from gpuresa.errors import UserError


class SourceError(UserError):
    """A calendar could not be read (network, authentication, HTTP status, bad URL, file...)."""


@dataclass(frozen=True)
class PollResult:
    """One poll: every object of the calendar, whether any changed, and what it cost."""

    objects: Mapping[str, bytes]
    changed: bool
    requests: int
    bytes_received: int
    # objects that could not be fetched or read this time, by href or file name: why
    # (their last good copy, if any, is in `objects`)
    problems: Mapping[str, str] = field(default_factory=dict)


class CalendarSource(Protocol):
    """A calendar to poll: a `CalDAVSource`, an `ICSSource` or a `GRRSource`."""

    name: str
    last_success: datetime | None

    def poll(self, now: datetime | None = None) -> PollResult:
        """Fetch what changed; raises `SourceError` with a one-line reason on any failure.

        `now` is recorded as the time of this success (default: the clock).
        """
        ...

    def snapshot(self) -> Mapping[str, bytes]:
        """The objects of the last successful poll (or of the snapshot on disk)."""
        ...


def open_source(
    calendar: CalendarConfig,
    state_dir: Path | None,
    *,
    persist: bool = True,
    reservations: ReservationsConfig | None = None,
    window: tuple[datetime, datetime] | None = None,
) -> CalendarSource:
    """The source for `calendar`: a `CalDAVSource`, an `ICSSource` or a `GRRSource`.

    Nothing is fetched yet; the snapshot under `state_dir` is loaded. With
    `persist` false (or no `state_dir`), the source never writes there: for
    commands that only look. A database source reads only a window:
    `reservations`' window_past and window_ahead around each poll's time, or
    the fixed `window` (calendars are read whole).
    """
    if calendar.kind == "grr":
        from gpuresa.reservations.sources.grr import GRRSource

        around = reservations or ReservationsConfig()
        return GRRSource(
            calendar,
            state_dir,
            persist=persist,
            window_past=around.window_past,
            window_ahead=around.window_ahead,
            window=window,
        )
    if calendar.kind == "caldav":
        from gpuresa.reservations.sources.caldav import CalDAVSource

        return CalDAVSource(calendar, state_dir, persist=persist)
    from gpuresa.reservations.sources.ics import ICSSource

    return ICSSource(calendar, state_dir, persist=persist)


def shown_url(url: str) -> str:
    """A URL for messages, logs and `gpuresa status`: nothing secret in it.

    Given any URL; returned as scheme://host[:port] and the first segment of
    the path, the rest of the path replaced by "…" (public calendar links
    carry their access token in the path, e.g. Nextcloud's
    /remote.php/dav/public-calendars/<token>). Never the query ("?…" marks
    one), the fragment or the user and password.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number: not shown either
        port = ""
    first, _, rest = parts.path.lstrip("/").partition("/")
    path = f"/{first}" if first or parts.path.startswith("/") else ""
    if rest:
        path += "/…"
    elif parts.path.endswith("/") and first:
        path += "/"
    if parts.query and not rest:
        path += "?…"
    return f"{parts.scheme}://{host}{port}{path}"


def url_secrets(url: str) -> list[str]:
    """The parts of `url` that `shown_url` leaves out, for `one_line`'s `hidden`.

    The whole URL, its path when `shown_url` shortens it (as written and
    decoded: HTTP libraries quote it in their errors) and its query; longest
    first, so no part of one is replaced before the whole.
    """
    parts = urlsplit(url)
    _, _, rest = parts.path.lstrip("/").partition("/")
    found = [url, parts.query]
    if rest:
        found += [parts.path, unquote(parts.path)]
    return sorted({secret for secret in found if secret}, key=len, reverse=True)


def icalendar_problem(data: bytes) -> str | None:
    """Why `data` is not a complete iCalendar stream, or None when it is one.

    Complete means: after an optional byte order mark and blank space, it
    starts with BEGIN:VCALENDAR and ends with END:VCALENDAR (names are
    case-insensitive, RFC 5545 3.1). Catches what would otherwise read as an
    empty calendar: an empty or half-written file, an HTML login page.
    """
    text = data.removeprefix(b"\xef\xbb\xbf").strip()
    if not text:
        return "it is empty"
    lines = text.splitlines()
    first, last = lines[0].strip().upper(), lines[-1].strip().upper()
    if first != b"BEGIN:VCALENDAR":
        if first.startswith((b"<!DOCTYPE", b"<HTML", b"<?XML", b"<")):
            return "it is an HTML or XML page, not iCalendar (a login page?)"
        return "it is not iCalendar (it does not start with BEGIN:VCALENDAR)"
    if last != b"END:VCALENDAR":
        return "it is incomplete (no END:VCALENDAR at its end; being written?)"
    return None


def one_line(error: BaseException, hidden: Iterable[str] = ()) -> str:
    """An exception as one short line for a `SourceError`.

    For a failed connection, the system's reason (`[Errno 111] Connection
    refused`) rather than the HTTP library's paragraph; any of the `hidden`
    strings (a URL's query with its access key) is replaced by "…".
    """
    text = " ".join(str(error).split()) or type(error).__name__
    system = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    if system is not None:
        text = system[0]
    for secret in hidden:
        if secret:
            text = text.replace(secret, "…")
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = [
    "CalendarSource",
    "PollResult",
    "SourceError",
    "icalendar_problem",
    "one_line",
    "open_source",
    "shown_url",
    "url_secrets",
]
