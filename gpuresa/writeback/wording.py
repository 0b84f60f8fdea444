"""What a booking's calendar says about it: the state block's words, one function per state.

Pure functions: given what the daemon knows at a change of state (the
reservation, the session, the lines the start e-mail gives), each returns a
`CalendarState`: the state's name (X-GPURESA-STATE), one line for tools
(X-GPURESA-DETAIL) and the lines users read in DESCRIPTION. A calendar is
often shared: nothing secret goes in (no FTP password, which the session
shows its user); what the start e-mail gives that a reader of the calendar
may see (the `ssh` line, the host's `@cert-authority` line for the session's
port, where output goes) is repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from gpuresa.mail.wording import format_time, one_line

# the states gpuresa writes (X-GPURESA-STATE), in lifecycle order
STATES = ("booked", "refused", "prepared", "running", "ended", "released", "preempted")
# a detail line is at most this long (a tool's summary; the block has the rest)
DETAIL_LIMIT = 300


@dataclass(frozen=True)
class CalendarState:
    """One state as the calendar shows it: name, a line for tools, lines for users."""

    state: str
    detail: str
    text: str


def _occurrence(start: datetime | None, timezone: str, series: bool) -> str:
    """ "" for a single booking; "Occurrence of <start>: " for one of a series (whose
    master event shows the occurrence gpuresa last wrote about)."""
    if not series or start is None:
        return ""
    return f"Occurrence of {format_time(start, timezone, offset=False)}: "


def booked(host: str, start: datetime, timezone: str, *, series: bool = False) -> CalendarState:
    """A booking gpuresa accepted and will serve (written only into a mirror)."""
    when = format_time(start, timezone)
    return CalendarState(
        "booked",
        f"booked on {host}",
        f"{_occurrence(start, timezone, series)}Booked on {host}; the session starts {when}.",
    )


def refused(
    reason: str, start: datetime | None, timezone: str, *, series: bool = False
) -> CalendarState:
    """A booking gpuresa will not serve, and why (`reason` quotes the booking: one line)."""
    why = one_line(reason, 1000)
    return CalendarState(
        "refused",
        one_line(why, DETAIL_LIMIT),
        f"{_occurrence(start, timezone, series)}Refused: {why}\n"
        "Change the booking and gpuresa reads it again.",
    )


def prepared(host: str, start: datetime, timezone: str, *, series: bool = False) -> CalendarState:
    """The session is prepared (image, GPUs and ports held) and starts at `start`."""
    when = format_time(start, timezone)
    return CalendarState(
        "prepared",
        f"prepared on {host}, starts {start.isoformat()}",
        f"{_occurrence(start, timezone, series)}Prepared on {host}: the session starts {when}.",
    )


def running(
    *,
    host: str,
    ssh_line: str,
    trust_lines: str,
    end: datetime,
    output_target: Path,
    outputs_command: str,
    timezone: str,
    start: datetime | None = None,
    series: bool = False,
) -> CalendarState:
    """The session runs: how to log in, the host key to trust, where the output goes.

    `ssh_line` is the start e-mail's `ssh -p PORT user@host`; `trust_lines`
    the `@cert-authority` line of the session's port (or the session's own
    host key fingerprint), `outputs_command` the `sftp` line that reads
    outputs during and after the session ("" without one).
    """
    lines = [
        f"{_occurrence(start, timezone, series)}Running on {host} until "
        f"{format_time(end, timezone)}.",
        "Log in with:",
        ssh_line,
    ]
    if trust_lines.strip():
        lines += ["Trust the host's key (add once to ~/.ssh/known_hosts):", trust_lines.strip()]
    lines.append(f"Keep results in {output_target}: that folder is kept after the end.")
    if outputs_command:
        lines += ["Read your outputs, during and after the session, with:", outputs_command]
    return CalendarState("running", ssh_line, "\n".join(lines))


def ended(
    *,
    host: str,
    at: datetime,
    output_dir: Path,
    outputs_command: str,
    removal: datetime | None,
    timezone: str,
    how: str = "ended",
    start: datetime | None = None,
    series: bool = False,
) -> CalendarState:
    """The session is over: `how` it ended ("ended", "released": nobody logged in in
    time, "preempted": its GPUs went to a firm booking), where its output is kept and
    until when (`removal` None: until an administrator removes it)."""
    why = {
        "released": " (released: nobody logged in in time)",
        "preempted": " (preempted: its GPUs went to a firm booking)",
    }.get(how, "")
    kept = (
        f"until {format_time(removal, timezone)}"
        if removal is not None
        else "until an administrator removes it"
    )
    lines = [
        f"{_occurrence(start, timezone, series)}Ended on {host} at "
        f"{format_time(at, timezone)}{why}.",
        f"The output is kept in {output_dir} on {host}, {kept}.",
    ]
    if outputs_command:
        lines += ["Download it with:", outputs_command]
    detail = f"output {output_dir} kept " + (
        f"until {removal.isoformat()}" if removal is not None else "until removed"
    )
    return CalendarState(
        how if how in ("released", "preempted") else "ended", detail, "\n".join(lines)
    )
