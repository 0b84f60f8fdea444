"""Notices to users: e-mail through one SMTP gateway, and text shown inside sessions.

`Notifier` is the only code that talks to an SMTP server. The message builders
(`start_message`, `warning_message`, …) and the in-container texts
(`banner_text`, `wall_text`) are pure functions: given a session or a
rejection, they return text, so the daemon decides when to send and the tests
read every message without a server.

Much of what ends up in a message was typed by a person in a booking form (the
occurrence key comes from the event's UID, a rejection's reason quotes the
bad value, the address may come from the event). Headers are therefore folded
to one line of printable text, recipient addresses must be plain ASCII
addr-specs, every body is made inert line by line (`gpuresa.inert`: control,
bidi and other invisible characters written as escapes) when it is composed,
and the in-container texts are made inert the same way. A notice quotes only
its own user's booking: a conflict names the other booking by host and time.
"""

from __future__ import annotations

import contextlib
import email.header
import email.message
import email.policy
import email.utils
import logging
import re
import smtplib
import socket
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from gpuresa.config.loading import read_secret
from gpuresa.config.reporting_sections import NotifyConfig
from gpuresa.config.schema import format_duration
from gpuresa.config.sections import UsersConfig
from gpuresa.errors import UserError
from gpuresa.inert import inert, inert_lines
from gpuresa.model import Rejection, Session

log = logging.getLogger(__name__)

SUBJECT_PREFIX = "[gpuresa]"
OUTPUT_TARGET = Path("/output")
# where a session shows its FTP password to its user (see gpuresa.runtime.session_files)
FTP_PASSWORD_PATH = Path("/etc/gpuresa/session/ftp-password")
# Longest Subject kept; the rest of a long (user-supplied) text is cut.
SUBJECT_LIMIT = 200
# A plain addr-spec: no display name, no spaces, commas or line breaks, ASCII only.
ADDRESS = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# Line breaks and blanks of every kind: one space each in a one-line text.
BREAKS = re.compile(r"[\t\n\v\f\r\x1c-\x1f\x85\u2028\u2029]")


class NotifyError(Exception):
    """An e-mail could not be sent; the message is one line that says why."""


def valid_address(address: str | None) -> str | None:
    """`address` stripped of surrounding blanks when it is a plain e-mail address, else None.

    Given an untrusted string (an event's organizer, a config value); a display
    name, a list, a line break or a non-ASCII character makes it invalid.
    """
    if address is None:
        return None
    candidate = address.strip()
    if len(candidate) > 254 or not ADDRESS.fullmatch(candidate):
        return None
    return candidate


def one_line(text: str, limit: int | None = None) -> str:
    """`text` as one line of printable characters: every run of line breaks and
    white space becomes one space, every other control or format character an
    escape (`gpuresa.inert`); cut to `limit` characters (with "…") if given.
    """
    flattened = " ".join(inert(BREAKS.sub(" ", text)).split())
    if limit is not None and len(flattened) > limit:
        flattened = flattened[: limit - 1].rstrip() + "…"
    return flattened


def printable(text: str) -> str:
    """`text` safe to show on a terminal: line breaks and tabs kept, every other
    control or format character (escape sequences, bidi controls) written as an escape.
    """
    return inert_lines(text)


class Notifier:
    """The SMTP gateway: resolves users' addresses and sends plain-text e-mail.

    Given the [notify] and [users] sections. Nothing is sent while
    `notify.enabled` is false; each call then only logs what it would send.
    """

    def __init__(self, config: NotifyConfig, users: UsersConfig) -> None:
        self.config = config
        self.users = users

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def address_for(self, user: str, email: str | None) -> str | None:
        """Where notices for `user` go, or None when no address is known.

        Given a login and the booking's own address (its organizer's e-mail,
        untrusted: anyone may book under any login). The order:

        1. `users.emails[user]`;
        2. else `user@email_domain` when `email_domain` is set;
        3. else `email`, but only when neither of the two is configured for
           `user`: the start notice carries the session's password, so it must
           not go to whoever wrote the login into a booking when the admin
           said where that login's mail goes.

        An invalid address is never used (and is logged); an invalid
        `users.emails` entry falls back to the domain, never to `email`.
        """
        configured = self.users.emails.get(user)
        if configured is not None:
            if valid_address(configured):
                return valid_address(configured)
            log.warning("users.emails[%r] is not a valid address: %r", user, configured)
        if self.users.email_domain:
            return valid_address(f"{user}@{self.users.email_domain}")
        if configured is not None:
            # the admin configured an address for this login, only a wrong one
            return None
        if email is not None:
            if valid_address(email):
                return valid_address(email)
            log.warning("the booking of %s gives an invalid address %r; not used", user, email)
        return None

    def configured_address(self, user: str) -> str | None:
        """Where the site says notices for `user` go (`users.emails`, else
        `email_domain`), or None: the only addresses a secret is e-mailed to."""
        configured = self.users.emails.get(user)
        if configured is not None:
            return valid_address(configured) or (
                valid_address(f"{user}@{self.users.email_domain}")
                if self.users.email_domain
                else None
            )
        if self.users.email_domain:
            return valid_address(f"{user}@{self.users.email_domain}")
        return None

    def send(
        self,
        to: str,
        subject: str,
        body: str,
        *,
        copy_admin: bool = False,
        key: str | None = None,
    ) -> None:
        """Send one plain-text e-mail to `to`; with `copy_admin`, Cc the admin too.

        Given a subject that is folded to one line (so untrusted text can add no
        header) and a body of any Unicode text. `key` names the reservation in
        the logs. Copy the admin only for failure notices. Raises `NotifyError`
        with a one-line reason when the address is invalid or the SMTP
        exchange fails (connection, TLS, login, refused recipient, time-out).
        """
        about = f" about {one_line(key, 100)}" if key else ""
        if not self.config.enabled:
            # notifications are switched off: say what would have gone out
            log.info(
                "e-mail disabled ([notify] enabled = false); not sending %r to %s%s",
                one_line(subject, SUBJECT_LIMIT),
                one_line(to, 100),
                about,
            )
            return
        recipient = valid_address(to)
        if recipient is None:
            raise NotifyError(f"not a valid e-mail address: {one_line(repr(to), 100)}")
        recipients = [recipient]
        admin = valid_address(self.config.admin) if copy_admin else None
        if admin is not None and admin != recipient:
            recipients.append(admin)
        message = self.compose(recipient, subject, body, copy=recipients[1:])
        sender = email.utils.parseaddr(self.config.sender)[1] or self.config.sender
        where = f"{self.config.smtp_host}:{self.config.smtp_port}"
        try:
            smtp = self._connect()
            try:
                refused = smtp.send_message(message, from_addr=sender, to_addrs=recipients)
            except BaseException:
                _quit(smtp)
                raise
            # accepted: close without waiting for QUIT's answer, so a relay that stalls
            # there cannot hold the message unmarked (and a restart send it twice)
            smtp.close()
        except smtplib.SMTPAuthenticationError as error:
            raise NotifyError(
                f"SMTP server {where} refused the login of {self.config.username!r}: "
                f"{_smtp_reason(error)}"
            ) from None
        except smtplib.SMTPRecipientsRefused as error:
            raise NotifyError(
                f"SMTP server {where} refused every recipient ({', '.join(recipients)})"
                f": {_refusals(error.recipients)}"
            ) from None
        except smtplib.SMTPResponseException as error:
            raise NotifyError(f"SMTP server {where} said: {_smtp_reason(error)}") from None
        except smtplib.SMTPServerDisconnected as error:
            if isinstance(error.__context__, TimeoutError):
                # smtplib turns a reply that never came into "disconnected"
                raise NotifyError(self._timed_out(where)) from None
            raise NotifyError(f"SMTP server {where} hung up: {one_line(str(error))}") from None
        except smtplib.SMTPException as error:
            raise NotifyError(
                f"SMTP exchange with {where} failed: {one_line(str(error))}"
            ) from None
        except ssl.SSLError as error:
            hint = ""
            if "WRONG_VERSION_NUMBER" in str(error):
                # TLS spoken to a plain-text port (or the reverse)
                hint = ' (check notify.security: "tls" is usually port 465, "starttls" 587)'
            raise NotifyError(
                f"TLS with SMTP server {where} failed: {_os_reason(error)}{hint}"
            ) from None
        except TimeoutError:
            raise NotifyError(self._timed_out(where)) from None
        except OSError as error:
            raise NotifyError(f"cannot reach SMTP server {where}: {_os_reason(error)}") from None
        if refused:
            # some recipients (the admin's copy, say) were refused, the main one was not
            log.warning("SMTP server %s refused %s%s", where, _refusals(refused), about)
        log.info("e-mailed %s: %s%s", ", ".join(recipients), one_line(subject, 100), about)

    def _timed_out(self, where: str) -> str:
        return (
            f"SMTP server {where} did not answer within {format_duration(self.config.timeout)} "
            "(notify.timeout)"
        )

    def compose(
        self, to: str, subject: str, body: str, *, copy: list[str] | tuple[str, ...] = ()
    ) -> email.message.EmailMessage:
        """The message `send` would send: headers Date, Message-ID, From, To, (Cc,) Subject.

        Given an address already checked with `valid_address`; the subject is
        folded to one line of at most `SUBJECT_LIMIT` characters.
        """
        # refold_source="none": the Subject is folded here, by `_encoded_subject`
        message = email.message.EmailMessage(policy=email.policy.SMTP.clone(refold_source="none"))
        sender_address = email.utils.parseaddr(self.config.sender)[1]
        domain = sender_address.rpartition("@")[2] or "localhost"
        message["Date"] = email.utils.format_datetime(datetime.now(UTC))
        message["Message-ID"] = email.utils.make_msgid("gpuresa", domain=domain)
        message["From"] = self.config.sender
        message["To"] = to
        if copy:
            message["Cc"] = ", ".join(copy)
        message.set_raw("Subject", _encoded_subject(one_line(subject, SUBJECT_LIMIT)))
        message["Auto-Submitted"] = "auto-generated"
        # the one place every body passes: calendar text in it cannot hide or reorder itself
        text = inert_lines(body if body.endswith("\n") else body + "\n")
        # 7bit when it can be; quoted-printable otherwise, so no 8BITMIME is needed
        message.set_content(
            text, charset="utf-8", cte=None if text.isascii() else "quoted-printable"
        )
        return message

    def _connect(self) -> smtplib.SMTP:
        """An SMTP connection, secured and logged in as [notify] says."""
        config = self.config
        timeout = config.timeout.total_seconds()
        context = self._tls_context()
        smtp: smtplib.SMTP
        if config.security == "tls":
            smtp = smtplib.SMTP_SSL(
                config.smtp_host, config.smtp_port, timeout=timeout, context=context
            )
        else:
            smtp = smtplib.SMTP(config.smtp_host, config.smtp_port, timeout=timeout)
        try:
            if config.security == "starttls":
                smtp.ehlo()
                if not smtp.has_extn("starttls"):
                    raise NotifyError(
                        f"SMTP server {config.smtp_host}:{config.smtp_port} does not offer "
                        'STARTTLS (set notify.security = "none" or "tls")'
                    )
                smtp.starttls(context=context)
                smtp.ehlo()
            if config.username:
                smtp.login(config.username, self._password())
        except BaseException:
            smtp.close()
            raise
        return smtp

    def _tls_context(self) -> ssl.SSLContext:
        if self.config.ca_file is None:
            return ssl.create_default_context()
        try:
            return ssl.create_default_context(cafile=str(self.config.ca_file))
        except (OSError, ssl.SSLError) as error:
            raise NotifyError(
                f"notify.ca_file: cannot read {self.config.ca_file}: {_os_reason(error)}"
            ) from None

    def _password(self) -> str:
        try:
            password = read_secret(
                "notify",
                self.config.password_file,
                self.config.password_credential,
                required=False,
            )
        except UserError as error:
            raise NotifyError(one_line(str(error))) from None
        if password is None:
            raise NotifyError(
                "notify.username is set but neither notify.password_file nor "
                "notify.password_credential is"
            )
        return password


def _quit(smtp: smtplib.SMTP) -> None:
    """Say goodbye and close; the message is already accepted, so a failure here is none."""
    with contextlib.suppress(smtplib.SMTPException, OSError):
        smtp.quit()
    smtp.close()


def _encoded_subject(subject: str) -> str:
    """A one-line subject folded and, unless ASCII, RFC 2047-encoded, ready to send.

    Python 3.11's own header folding splits an encoded word across lines in
    long non-ASCII subjects (the reader then sees "=?utf-8?b?…"), and moves a
    long value to a continuation line; the older `email.header` does neither.
    """
    charset = "us-ascii" if subject.isascii() else "utf-8"
    header = email.header.Header(subject, charset, maxlinelen=78, header_name="Subject")
    return header.encode(linesep="\r\n")


def _smtp_reason(error: smtplib.SMTPResponseException) -> str:
    text = (
        error.smtp_error.decode("utf-8", "replace")
        if isinstance(error.smtp_error, bytes)
        else str(error.smtp_error)
    )
    return one_line(f"{error.smtp_code} {text}", 300)


def _refusals(refused: dict[str, tuple[int, bytes]]) -> str:
    return one_line(
        "; ".join(
            f"{address}: {code} {reply.decode('utf-8', 'replace')}"
            for address, (code, reply) in refused.items()
        ),
        300,
    )


def _os_reason(error: OSError) -> str:
    if isinstance(error, socket.gaierror):
        return f"unknown host ({error.strerror})"
    return one_line(error.strerror or str(error) or type(error).__name__, 300)


# --- time and duration in words -------------------------------------------------


def format_time(instant: datetime, timezone: str, *, offset: bool = True) -> str:
    """`instant` in the site's time zone, with the zone's name and UTC offset.

    Given an aware datetime and an IANA zone name; returns, for example,
    "Friday 2024-05-03 18:00 CEST (UTC+02:00)", without the "(UTC…)" part
    when `offset` is false (for subjects: see `format_clock`). English
    weekday names whatever the locale.
    """
    local = instant.astimezone(ZoneInfo(timezone))
    text = f"{WEEKDAYS[local.weekday()]} {local:%Y-%m-%d %H:%M} {local.tzname()}"
    return f"{text} ({_utc_offset(local)})" if offset else text


def format_clock(instant: datetime, timezone: str, *, offset: bool = True) -> str:
    """`instant` as a clock time in the site's zone: "18:00 CEST (UTC+02:00)".

    Without `offset`, only "18:00 CEST" (for subjects: the parentheses make
    Python's header folding start a continuation line).
    """
    local = instant.astimezone(ZoneInfo(timezone))
    if not offset:
        return f"{local:%H:%M} {local.tzname()}"
    return f"{local:%H:%M} {local.tzname()} ({_utc_offset(local)})"


def _utc_offset(local: datetime) -> str:
    offset = local.utcoffset() or timedelta(0)
    sign = "-" if offset < timedelta(0) else "+"
    minutes = abs(int(offset.total_seconds())) // 60
    return f"UTC{sign}{minutes // 60:02d}:{minutes % 60:02d}"


def format_remaining(remaining: timedelta) -> str:
    """A duration in words, to the minute (to the second under a minute).

    "15 minutes", "1 hour 5 minutes", "2 days 3 hours", "30 seconds".
    """
    seconds = max(0, round(remaining.total_seconds()))
    if seconds < 60:
        return _plural(seconds, "second")
    minutes = round(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    parts = [
        _plural(amount, unit)
        for amount, unit in ((days, "day"), (hours, "hour"), (minutes, "minute"))
        if amount
    ]
    return " ".join(parts)


def _plural(amount: int, unit: str) -> str:
    return f"{amount} {unit}" if amount == 1 else f"{amount} {unit}s"


def _gpus(gpus: tuple[int, ...]) -> str:
    if not gpus:
        return "none"
    count = _plural(len(gpus), "GPU")
    return f"{', '.join(str(index) for index in gpus)} ({count})"


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
) -> tuple[str, str]:
    """The notice sent when a session starts: how to log in, FTP access, the end.

    Without `ftps` (a session with no FTPS sidecar: udocker's) the output is
    fetched over SFTP through the session's own SSH server, and the notice says so.

    Without `password_in_mail` (an address that came from the calendar, which
    anyone may write) the FTP password is left out: the user reads it in the
    session, at `FTP_PASSWORD_PATH`.

    Given the running session (with its FTP credentials), the host name users
    connect to (`[[hosts]].public_name`, else its name) and the site time zone;
    `details` (the host CA line, the output service: `outputs.messages.start_details`)
    is added before the closing lines. The body holds the exact line
    `ssh -p PORT user@host` on a line of its own.
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

  GPUs:      {_gpus(session.gpus)}
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
WinSCP, curl), for example:
  lftp -e "set ftp:ssl-force true" -p {session.ftp_port} -u {session.ftp_user} {public_host}"""


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
    what = f"{_template(session)}, GPUs {_gpus(session.gpus)}"
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
