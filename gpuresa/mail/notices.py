"""Notices to users: the text of every e-mail, and text shown inside sessions.

The message builders (`start_message`, `warning_message`, …) and the
in-container texts (`banner_text`, `wall_text`) are pure functions: given a
session or a rejection, they return text, so the daemon decides when to send
(through the one SMTP gateway, `gpuresa.mail.smtp`) and the tests read every
message without a server.

Much of what ends up in a message was typed by a person in a booking form (the
occurrence key comes from the event's UID, a rejection's reason quotes the
bad value). Quoted values are folded to one line (`one_line`), every body is
made inert line by line when the gateway composes it, and the in-container
texts are made inert the same way (`gpuresa.inert`: control, bidi and other
invisible characters written as escapes). A notice quotes only its own user's
booking: a conflict names the other booking by host and time.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.inert import inert_lines
from gpuresa.mail.wording import format_clock, format_remaining, format_time, one_line, plural
from gpuresa.model import Rejection, Session

SUBJECT_PREFIX = "[gpuresa]"
OUTPUT_TARGET = Path("/output")
# where a session shows its FTP password to its user (see gpuresa.sessions.files)
FTP_PASSWORD_PATH = Path("/etc/gpuresa/session/ftp-password")


def printable(text: str) -> str:
    """`text` safe to show on a terminal: line breaks and tabs kept, every other
    control or format character (escape sequences, bidi controls) written as an escape.
    """
    return inert_lines(text)


def _gpus(session: Session) -> str:
    count = plural(session.gpu_count, "GPU")
    if session.gpu_indices:
        return f"{', '.join(str(index) for index in session.gpu_indices)} ({count})"
    # a scheduler's session: its node chooses the devices
    return f"{count} on its node" if session.gpu_count else "none"


def _template(session: Session) -> str:
    return f"{session.template} (CUDA {session.cuda})" if session.cuda else session.template


# --- e-mail messages: (subject, body) ---------------------------------------------


def start_message(
    session: Session,
    public_host: str,
    timezone: str,
    *,
    output_target: Path = OUTPUT_TARGET,
    details: str = "",
    password_in_mail: bool = True,
    ftps: bool = True,
    tools: str = "",
) -> tuple[str, str]:
    """The notice sent when a session starts: how to log in, FTP access, the end.

    Without `ftps` (a session with no FTPS sidecar: udocker's, a Slurm job's) the output is
    fetched over SFTP through the session's own SSH server, and the notice says so.

    Without `password_in_mail` (an address that came from the calendar, which
    anyone may write) the FTP password is left out: the user reads it in the
    session, at `FTP_PASSWORD_PATH`.

    Given the running session (with its FTP credentials), the host name users
    connect to (`[[hosts]].public_name`, else its name) and the site time zone;
    `details` (the host CA line, the output service: `outputs.messages.start_details`)
    is added before the closing lines; `tools` (the template's browser tools: each one's
    `ssh -L` line and URL, `gpuresa.sessions.tools.tools_text`) after the login line.
    The body holds the exact line `ssh -p PORT user@host` on a line of its own.
    """
    end = format_time(session.end, timezone)
    until = format_clock(session.end, timezone, offset=False)
    subject = f"{SUBJECT_PREFIX} Your GPU session on {session.host} is ready, until {until}"
    password = (
        session.ftp_password if password_in_mail else f"in the session: cat {FTP_PASSWORD_PATH}"
    )
    body = f"""\
Hello {session.user},

your GPU session on {session.host} has started. Log in with:

ssh -p {session.ssh_port} {session.user}@{public_host}
{_tools_paragraph(tools)}
  GPUs:      {_gpus(session)}
  Template:  {_template(session)}
  Ends:      {end}

You have sudo inside the session. Keep your results in {output_target}: that
folder is kept after the end; everything else in the session is lost when it
stops. {
        _transfer(session, public_host, output_target, password)
        if ftps
        else _sftp_transfer(session, public_host, output_target)
    }
{details}
You will be warned by e-mail and in the session before the end.

Reservation: {one_line(session.key)}
"""
    return subject, body


def _tools_paragraph(tools: str) -> str:
    """The start notice's lines of the template's browser tools, set off by blank lines."""
    return f"\n{tools.rstrip()}\n" if tools.strip() else ""


# what lftp needs to insist on TLS and check the host's certificate (saved as ftps.pem)
_LFTP_SETTINGS = "set ftp:ssl-force true; set ssl:ca-file ftps.pem"


def _transfer(session: Session, public_host: str, output_target: Path, password: str) -> str:
    """The start notice's FTPS paragraph (a session with an FTPS sidecar)."""
    return f"""\
While the session runs, {output_target} is also served over FTPS
(FTP with explicit TLS; this password is for this session only):

  FTP host:      {public_host}
  FTP port:      {session.ftp_port}
  FTP login:     {session.ftp_user}
  FTP password:  {password}
  Passive ports: {session.ftp_passive_first}-{session.ftp_passive_last}

With a client that keeps one TLS session for the whole login (lftp, FileZilla,
WinSCP, curl) and the FTPS certificate below saved as ftps.pem, for example:
  lftp -e "{_LFTP_SETTINGS}" -p {session.ftp_port} -u {session.ftp_user} {public_host}
  curl --ssl-reqd --cacert ftps.pem -u {session.ftp_user} -T FILE ftp://{public_host}:{session.ftp_port}/"""


def _sftp_transfer(session: Session, public_host: str, output_target: Path) -> str:
    """The start notice's SFTP paragraph (a session whose own sshd serves files)."""
    login = f"{session.user}@{public_host}"
    return f"""\
While the session runs, its files (and {output_target}) are
reachable over SFTP through the session's own SSH server, with the same key:

  sftp -P {session.ssh_port} {login}
  scp -P {session.ssh_port} '{login}:{output_target}/*' .
"""


def warning_message(
    session: Session,
    remaining: timedelta,
    timezone: str,
    *,
    output_target: Path = OUTPUT_TARGET,
) -> tuple[str, str]:
    """The notice sent `remaining` before the end of a session."""
    left = format_remaining(remaining)
    subject = f"{SUBJECT_PREFIX} Your GPU session on {session.host} ends in {left}"
    body = f"""\
Hello {session.user},

your GPU session on {session.host} ends in {left}, at
{format_time(session.end, timezone)}.

Save your work to {output_target} now: that folder is kept after the end;
everything else in the session is lost when it stops.

Reservation: {one_line(session.key)}
"""
    return subject, body


def end_message(
    session: Session, output_dir: Path, timezone: str, *, details: str = ""
) -> tuple[str, str]:
    """The notice sent when a session has been stopped: where its output is kept.

    Given the folder on the host that held the session's output; `details`
    (how to download it and until when: `outputs.messages.end_details`) is
    added after it.
    """
    subject = f"{SUBJECT_PREFIX} Your GPU session on {session.host} has ended"
    body = f"""\
Hello {session.user},

your GPU session on {session.host} ended at {format_time(session.end, timezone)}.

What you saved in the session's output folder is kept on {session.host} in:

  {output_dir}
{details}
Reservation: {one_line(session.key)}
"""
    return subject, body


def rejection_message(rejection: Rejection, timezone: str) -> tuple[str, str]:
    """The notice sent when a booking cannot become a reservation, with the reason."""
    when = ""
    if rejection.start is not None:
        when = f" for {format_time(rejection.start, timezone, offset=False)}"
    greeting = f"Hello {rejection.user}," if rejection.user else "Hello,"
    period = ""
    if rejection.start is not None and rejection.end is not None:
        period = (
            f"\n  From:      {format_time(rejection.start, timezone)}"
            f"\n  Until:     {format_time(rejection.end, timezone)}"
        )
    subject = f"{SUBJECT_PREFIX} Booking{when} rejected"
    body = f"""\
{greeting}

your booking in the calendar "{rejection.calendar}" cannot be served:

  Reason:    {one_line(rejection.reason)}{period}

No session will start for it. Change the booking in the calendar and it
will be checked again.

Reservation: {one_line(rejection.key)}
"""
    return subject, body


def cancel_message(
    session: Session,
    stop_at: datetime,
    timezone: str,
    *,
    output_target: Path = OUTPUT_TARGET,
) -> tuple[str, str]:
    """The notice sent when a running session's booking was cancelled or deleted.

    Given when the session will be stopped (after the cancel grace).
    """
    stop = format_clock(stop_at, timezone, offset=False)
    subject = f"{SUBJECT_PREFIX} Cancelled: your session on {session.host} stops at {stop}"
    body = f"""\
Hello {session.user},

the booking of your running GPU session on {session.host} was cancelled or
removed from the calendar. The session stops at
{format_time(stop_at, timezone)}
instead of {format_time(session.end, timezone)}.

Save your work to {output_target} now: that folder is kept after the end;
everything else in the session is lost when it stops.

Reservation: {one_line(session.key)}
"""
    return subject, body


def failure_message(key: str, user: str, error: str, *, host: str | None = None) -> tuple[str, str]:
    """The notice sent (with the admin in copy) when a session could not be started."""
    where = f" on {host}" if host else ""
    subject = f"{SUBJECT_PREFIX} Your GPU session{where} could not be started"
    body = f"""\
Hello {user},

your GPU session{where} could not be started:

  {one_line(error)}

The administrators received a copy of this message. If the session starts
later on, you will get the usual notice.

Reservation: {one_line(key)}
"""
    return subject, body


# --- text shown inside a session -----------------------------------------------------


def banner_text(session: Session, timezone: str, *, output_target: Path = OUTPUT_TARGET) -> str:
    """The banner shown at login in the session (motd): who, what, until when.

    Free of terminal control characters, whatever the booking said.
    """
    what = f"{_template(session)}, GPUs {_gpus(session)}"
    text = f"""\
gpuresa session of {session.user} on {session.host}: {what}
This session ends {format_time(session.end, timezone)}; it is then stopped.
Keep your results in {output_target}: it is kept after the end; everything else is lost.
Reservation: {one_line(session.key)}
"""
    return printable(text)


def wall_text(
    remaining: timedelta,
    end: datetime,
    timezone: str,
    *,
    output_target: Path = OUTPUT_TARGET,
) -> str:
    """The message written to logged-in users (wall) `remaining` before `end`."""
    return (
        f"gpuresa: this session ends in {format_remaining(remaining)}, at "
        f"{format_clock(end, timezone)}.\n"
        f"Save your work to {output_target} now: everything else is lost when the "
        "session stops.\n"
    )
