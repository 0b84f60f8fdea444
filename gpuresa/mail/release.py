"""What the user of a booked session nobody logged into reads: the warning, and the end.

Where `release_unused` is set (`gpuresa.planning.release`), a firm session with
no login that long after its start is released: these texts tell its user
when, why, and what keeps it (one login), and then that it ended early.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from gpuresa.mail.notices import OUTPUT_TARGET, SUBJECT_PREFIX
from gpuresa.mail.wording import format_clock, format_remaining, format_time, one_line
from gpuresa.model import Session


def release_message(
    session: Session, release_at: datetime, unused_for: timedelta, timezone: str
) -> tuple[str, str]:
    """The warning sent when a session nobody logged into is released at `release_at`."""
    at = format_clock(release_at, timezone, offset=False)
    subject = f"{SUBJECT_PREFIX} Your unused GPU session on {session.host} ends at {at}"
    body = f"""\
Hello {session.user},

your GPU session on {session.host} started {format_remaining(unused_for)} ago
and nobody has logged into it yet (by SSH, SFTP or FTP). Unless you log in
before {format_time(release_at, timezone)}, it is released then: the session
stops, before the end it was booked for, and its GPUs go to others who can
use them now. What is in {OUTPUT_TARGET} is kept.

One login keeps the session until the end of its booking: see the e-mail
sent at its start for the command.

Reservation: {one_line(session.key)}
"""
    return subject, body


def release_wall_text(remaining: timedelta, release_at: datetime, timezone: str) -> str:
    """The message written in the session (its own files) before the release."""
    return (
        f"gpuresa: nobody has logged into this session; it is released in "
        f"{format_remaining(remaining)}, at {format_clock(release_at, timezone)}, "
        "unless someone logs in.\n"
    )


def released_end_line(stopped_at: datetime, timezone: str) -> str:
    """What the end notice of a released session says of its early end."""
    return (
        f"It was released at {format_time(stopped_at, timezone)}, before its booked end,\n"
        "because nobody had logged into it; its GPUs went to others.\n"
    )
