"""The SMTP gateway: the only code that talks to an SMTP server.

`Notifier` resolves a login's address and sends one plain-text e-mail: TLS or
STARTTLS as [notify] says, a login with a password from a file or a systemd
credential, and every failure turned into a one-line `NotifyError`. The texts
it sends are built in `gpuresa.mail.notices`.

Addresses may come from a booking form (an event's organizer) and subjects
quote booking text: headers are therefore folded to one line of printable text,
recipient addresses must be plain ASCII addr-specs, and every body is made inert
line by line (`gpuresa.inert`) when the message is composed.
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
from datetime import UTC, datetime

from gpuresa.config.loading import read_secret
from gpuresa.config.reporting_sections import NotifyConfig
from gpuresa.config.schema import format_duration
from gpuresa.config.sections import UsersConfig
from gpuresa.errors import UserError
from gpuresa.inert import inert_lines
from gpuresa.mail.wording import one_line

log = logging.getLogger(__name__)

# Longest Subject kept; the rest of a long (user-supplied) text is cut.
SUBJECT_LIMIT = 200
# A plain addr-spec: no display name, no spaces, commas or line breaks, ASCII only.
ADDRESS = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")


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
