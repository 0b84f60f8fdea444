"""What the user of a preemptible session reads: at its start, before it must stop, at the end.

The texts a preemptible session adds to the others (`gpuresa.mail.notices`):
the start notice says what preemptible means and which signal to catch; the
notice before the stop says when, by e-mail and in the session; the end
notice says why it ended before its booking did.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.mail.notices import OUTPUT_TARGET, SUBJECT_PREFIX
from gpuresa.mail.wording import format_clock, format_remaining, format_time, one_line
from gpuresa.model import Session


def preemptible_lines(notice: timedelta, signal_name: str) -> str:
    """The start notice's paragraph about preemption."""
    return f"""
This session is preemptible: it runs on GPUs nobody booked, and gives them
up when a booking needs them. You will then be told {format_remaining(notice)}
ahead (by e-mail and in the session), and every process of the session that
catches {signal_name} gets it (the others are left alone): catch it to save a
checkpoint to {OUTPUT_TARGET}, for example in Python
  signal.signal(signal.{signal_name}, lambda *_: save_checkpoint())
"""


def preempt_message(
    session: Session, stop_at: datetime, signal_name: str, timezone: str
) -> tuple[str, str]:
    """The notice sent when a preemptible session must give its GPUs up at `stop_at`."""
    stop = format_clock(stop_at, timezone, offset=False)
    subject = f"{SUBJECT_PREFIX} Your preemptible session on {session.host} stops at {stop}"
    body = f"""\
Hello {session.user},

a booking needs the GPUs of your preemptible session on {session.host}: the
session stops at {format_time(stop_at, timezone)}, before the end it was
booked for. Its processes that catch {signal_name} have just been sent it.

Save your work to {OUTPUT_TARGET} now: that folder is kept after the stop;
everything else in the session is lost.

Reservation: {one_line(session.key)}
"""
    return subject, body


def preempt_wall_text(
    remaining: timedelta, stop_at: datetime, timezone: str, *, output_target: Path = OUTPUT_TARGET
) -> str:
    """The message written to logged-in users of a preemptible session before its stop."""
    return (
        f"gpuresa: a booking needs this session's GPUs: it stops in "
        f"{format_remaining(remaining)}, at {format_clock(stop_at, timezone)}.\n"
        f"Save your work to {output_target} now: everything else is lost when the "
        "session stops.\n"
    )


def preempted_end_line(stopped_at: datetime, timezone: str) -> str:
    """What the end notice of a preempted session says of its early end."""
    return (
        f"It was stopped at {format_time(stopped_at, timezone)}, before its booked end,\n"
        "because a booking needed its GPUs (it was preemptible).\n"
    )
