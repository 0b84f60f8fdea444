"""Calendar sources: where calendar objects come from (CalDAV or ICS), one gateway each.

A source's `poll()` returns every object of its calendar (href or file name ->
iCalendar bytes), says whether anything changed since the last poll, and
counts the requests and bytes it took. Each source keeps its last good
snapshot under `<state_dir>/calendars/<name>/`, loaded when it is made, so a
restarted daemon has its reservations before (or without) the server; any
failure raises `SourceError` with a one-line reason and leaves the snapshot
as it was.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from gpuresa.config import CalendarConfig
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


class CalendarSource(Protocol):
    """A calendar to poll; `CalDAVSource` and `ICSSource` are the two kinds."""

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
    calendar: CalendarConfig, state_dir: Path | None, *, persist: bool = True
) -> CalendarSource:
    """The source for `calendar`: a `CalDAVSource` or an `ICSSource`, by its `kind`.

    Nothing is fetched yet; the snapshot under `state_dir` is loaded. With
    `persist` false (or no `state_dir`), the source never writes there: for
    commands that only look.
    """
    if calendar.kind == "caldav":
        from gpuresa.sources.caldav_source import CalDAVSource

        return CalDAVSource(calendar, state_dir, persist=persist)
    from gpuresa.sources.ics_source import ICSSource

    return ICSSource(calendar, state_dir, persist=persist)


def shown_url(url: str) -> str:
    """A URL for messages: scheme, host and path; credentials and query left out."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    hidden = "?…" if parts.query else ""
    return f"{parts.scheme}://{host}{port}{parts.path}{hidden}"


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


__all__ = ["CalendarSource", "PollResult", "SourceError", "one_line", "open_source", "shown_url"]
