"""The mirror calendar's events: one per booking, with the booking's times and its state.

Where the booking app owns the events (GRR publishing to CalDAV, a read-only
feed, an ICS folder), gpuresa writes into a calendar of its own that users
subscribe to. Pure: `mirror_name` and `mirror_event` turn a booking's
write-back row into the object's name and text. The object is gpuresa's
alone, so it is written whole (no user text to keep); its UID is derived
from the booking's key, so a booking has one event whatever happens, and
DTSTAMP is the time the state was queued, so writing the same state twice
gives the same bytes.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from gpuresa.ical.state_block import (
    BLOCK_END,
    BLOCK_START,
    DETAIL_PROPERTY,
    STATE_PROPERTY,
    escape_text,
    fold,
)
from gpuresa.journal.writeback import WriteBackRow

# what a calendar app shows as the event's status, by state
_STATUS = {
    "booked": "TENTATIVE",
    "refused": "CANCELLED",
    "prepared": "CONFIRMED",
    "running": "CONFIRMED",
    "ended": "CONFIRMED",
    "released": "CONFIRMED",
    "preempted": "CONFIRMED",
}


def mirror_uid(key: str) -> str:
    """The mirror event's UID for booking `key`: stable, and no booking's own UID."""
    return "gpuresa-mirror-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def mirror_name(key: str) -> str:
    """The mirror object's name inside the mirror collection."""
    return mirror_uid(key) + ".ics"


def _stamp(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def mirror_event(row: WriteBackRow) -> str | None:
    """The mirror's VCALENDAR for `row`, CRLF lines; None when the booking has no times
    to show (a booking refused before its times could be read)."""
    if row.start is None or row.end is None:
        return None
    title = f"{row.summary or row.key} — {row.state}"
    block = f"{BLOCK_START}\n{row.text.strip()}\n{BLOCK_END}"
    lines = [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:-//gpuresa//write-back mirror//EN",
        "BEGIN:VEVENT",
        f"UID:{mirror_uid(row.key)}",
        f"DTSTAMP:{_stamp(row.queued_at)}",
        f"DTSTART:{_stamp(row.start)}",
        f"DTEND:{_stamp(row.end)}",
        "SUMMARY:" + escape_text(title),
        "DESCRIPTION:" + escape_text(block),
        f"STATUS:{_STATUS.get(row.state, 'CONFIRMED')}",
        "TRANSP:TRANSPARENT",
        f"{STATE_PROPERTY}:{escape_text(row.state)}",
        f"{DETAIL_PROPERTY}:{escape_text(row.detail)}",
        "X-GPURESA-KEY:" + escape_text(row.key),
        "END:VEVENT",
        "END:VCALENDAR",
    ]
    return "".join(part for line in lines for part in fold(line, "\r\n"))
