"""Where each calendar's write-back writes, as whom, and whether it is on.

`event_account` and `mirror_account` say where a calendar's states go;
`write_off_reason` whether a permanent refusal turned its write-back off
(until its configuration changes: the journal fact `writeback-off:<calendar>`
holds the configuration's fingerprint and the reason); `write_back_status`
sums it up for `gpuresa status`.
"""

from __future__ import annotations

import hashlib

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.sections import Config
from gpuresa.journal.store import Journal
from gpuresa.journal.writeback import WriteBackRow
from gpuresa.reservations.sources.caldav_write import Account

# the journal fact that says a calendar's write-back is off: "<fingerprint>\t<reason>"
OFF_FACT = "writeback-off:"


def fingerprint(calendar: CalendarConfig) -> str:
    """What identifies a calendar's configuration: a change turns a refused write-back on."""
    return hashlib.sha256(repr(calendar).encode()).hexdigest()[:16]


def event_account(calendar: CalendarConfig) -> Account:
    """Where "event" write-back writes: the calendar itself, with its own account."""
    return Account(
        calendar.url,
        calendar.username,
        calendar.password_file,
        calendar.password_credential,
        calendar.auth,
        calendar.verify_tls,
        f"calendars[{calendar.name}]",
    )


def mirror_account(calendar: CalendarConfig) -> Account:
    """Where "mirror" write-back writes: `mirror_url`, with the mirror's account (else the
    calendar's own)."""
    assert calendar.mirror_url is not None
    if calendar.mirror_username is not None:
        return Account(
            calendar.mirror_url,
            calendar.mirror_username,
            calendar.mirror_password_file,
            calendar.mirror_password_credential,
            calendar.auth,
            calendar.verify_tls,
            f"calendars[{calendar.name}].mirror",
        )
    own = event_account(calendar)
    return Account(
        calendar.mirror_url,
        own.username,
        own.password_file,
        own.password_credential,
        own.auth,
        own.verify_tls,
        own.label,
    )


def write_off_reason(journal: Journal, calendar: CalendarConfig) -> str | None:
    """Why `calendar`'s write-back is off (a refusal under this configuration), or None."""
    found = journal.facts.get(OFF_FACT + calendar.name)
    if found is None:
        return None
    stamp, _, reason = found.partition("\t")
    return reason if stamp == fingerprint(calendar) else None


def write_back_status(journal: Journal, config: Config) -> dict[str, str]:
    """For `gpuresa status`: each calendar with write-back on, by name, and how it stands:
    "on", "on, N state(s) waiting (last error: …)" or "off: <why>"."""
    waiting: dict[str, list[WriteBackRow]] = {}
    for row in journal.writeback.unwritten():
        waiting.setdefault(row.calendar, []).append(row)
    found = {}
    for calendar in config.calendars:
        if calendar.write_back == "off":
            continue
        off = write_off_reason(journal, calendar)
        rows = waiting.get(calendar.name, [])
        if off is not None:
            found[calendar.name] = f"off: {off}"
        elif rows:
            error = next((row.last_error for row in reversed(rows) if row.last_error), None)
            found[calendar.name] = f"on, {len(rows)} state(s) waiting" + (
                f" (last error: {error})" if error else ""
            )
        else:
            found[calendar.name] = "on"
    return found
