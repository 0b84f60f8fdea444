"""GRR rows as calendar objects: what the other sources hand on, so one reader reads all.

Pure: given the rows of GRR's tables that `grr_source` read, returns one
small iCalendar object per booking (`entry-<id>.ics`), which
`gpuresa.reservations.booking` reads like any calendar's event:

- UID `grr:<table prefix>:<id>`: GRR keeps a row's id when the row is edited,
  and stores each occurrence of a series as a row of its own, so an
  occurrence moved or deleted on its own stays one booking;
- DTSTART/DTEND from the Unix timestamps, written in UTC (no time zone is
  guessed);
- SUMMARY the login: the GRR account the booking is for (`beneficiaire`,
  as `grr_utilisateurs` spells it, in lower case: GRR writes logins in upper
  case), and X-GPURESA-SUMMARY saying so, so that a refusal names GRR's
  field rather than a title (GRR's short description, `name`, is not read);
  ORGANIZER that account's e-mail address, so `user_from = "organizer"` and
  `email_logins` work as for calendars, and notices go there;
- LOCATION the host the calendar's `rooms` maps the row's room to;
- DESCRIPTION GRR's description, where `template:`, `cuda:` and `gpus:`
  lines are read as in any event;
- X-GPURESA-REFUSED the reasons gpuresa refuses the row whatever it says: a
  room booked by periods, a booking for an outside person or an unknown or
  disabled GRR account.

Every value comes from a web form: text is escaped (RFC 5545 TEXT), so no
value can end the event or add a property.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

_EMAIL = re.compile(r"[^@\s<>(),;:\"\\\[\]]{1,64}@[A-Za-z0-9.-]{1,253}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_NAME_LIMIT = 80


@dataclass(frozen=True)
class Room:
    """A GRR room (`grr_room`) and its area's booking mode (`grr_area.enable_periods`)."""

    id: int
    name: str
    area: str
    by_periods: bool


@dataclass(frozen=True)
class Entry:
    """One live row of `grr_entry` (not deleted, not pending or refused by a moderator),
    with its beneficiary's account from `grr_utilisateurs` (None when there is none)."""

    id: int
    start_time: int
    end_time: int
    room_id: int
    beneficiary: str
    beneficiary_outside: str
    description: str
    account: str | None
    account_email: str | None
    account_state: str | None


def entry_key(prefix: str, entry_id: int) -> str:
    """The UID (and so the reservation key) of a GRR row: `grr:<prefix>:<id>`."""
    return f"grr:{prefix}:{entry_id}"


def entry_object(entry: Entry, room: Room, host: str, prefix: str) -> tuple[str, bytes]:
    """The calendar object of `entry`, booked in `room` (which the config maps to `host`).

    Returns (object name, iCalendar bytes). Never raises for the row's content.
    """
    lines = [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:-//gpuresa//GRR database//EN",
        "BEGIN:VEVENT",
        f"UID:{entry_key(prefix, entry.id)}",
        f"DTSTART:{_utc(entry.start_time)}",
        f"DTEND:{_utc(entry.end_time)}",
        f"LOCATION:{_text(host)}",
    ]
    login = (entry.account or entry.beneficiary).strip().lower()
    if login:
        lines.append(f"SUMMARY:{_text(login)}")
    # refusals then speak of the beneficiary, as GRR's admins know it, not of a title
    lines.append("X-GPURESA-SUMMARY:grr-beneficiary")
    email = (entry.account_email or "").strip()
    if entry.account is not None and len(email) <= 254 and _EMAIL.fullmatch(email):
        lines.append(f"ORGANIZER:mailto:{email}")
    if entry.description:
        lines.append(f"DESCRIPTION:{_text(entry.description)}")
    for reason in refusals(entry, room):
        lines.append(f"X-GPURESA-REFUSED:{_text(reason)}")
    lines += ["END:VEVENT", "END:VCALENDAR", ""]
    return f"entry-{entry.id}.ics", "\r\n".join(lines).encode("utf-8", "replace")


def refusals(entry: Entry, room: Room) -> list[str]:
    """Why gpuresa refuses `entry` whatever its description says (empty: it does not)."""
    found = []
    if room.by_periods:
        found.append(
            f"GRR room {_show(room.name)} (area {_show(room.area)}) books by periods, whose "
            "times are period numbers rather than clock times; book a room of an area that "
            "books by time"
        )
    if not entry.beneficiary.strip():
        outside = entry.beneficiary_outside.split("|", 1)[0].strip()
        who = f" ({_show(outside)})" if outside else ""
        found.append(f"booked for a person outside GRR{who}, who has no login here")
    elif entry.account is None:
        found.append(f"GRR login {_show(entry.beneficiary)} is no GRR account (unknown login)")
    elif (entry.account_state or "").strip().lower() != "actif":
        found.append(f"GRR account {_show(entry.account)} is disabled in GRR")
    return found


def _utc(stamp: int) -> str:
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y%m%dT%H%M%SZ")


def _text(value: str) -> str:
    """An RFC 5545 TEXT value: escapes for '\\', ';', ',' and line breaks; no controls."""
    value = _CONTROL.sub("", value.replace("\r\n", "\n").replace("\r", "\n"))
    return value.replace("\\", "\\\\").replace(";", "\\;").replace(",", "\\,").replace("\n", "\\n")


def _show(value: str) -> str:
    shown = _CONTROL.sub("", value).replace("\n", " ").strip()
    return repr(shown if len(shown) <= _NAME_LIMIT else shown[: _NAME_LIMIT - 3] + "...")
