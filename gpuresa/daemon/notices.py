"""Which notice goes to whom, with the key the outbox deduplicates it by.

Every e-mail of the daemon goes through the outbox (`gpuresa.mail.outbox`): a relay
that hangs delays nothing but mail, and a notice is never lost or sent twice
across restarts. The texts of the user's notices live in `gpuresa.mail.notices`;
those that only the daemon sends (a booking given to someone else, a change a
running session cannot follow, the admin's reports) are here.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from gpuresa.config.sections import Config
from gpuresa.daemon.tool_lines import start_tool_lines
from gpuresa.gpus.findings import GpuLostFromHost, GpuLostInSession, IdleBooking, UnbookedProcess
from gpuresa.mail.notices import (
    SUBJECT_PREFIX,
    cancel_message,
    end_message,
    failure_message,
    rejection_message,
    start_message,
    warning_message,
)
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.preemption import preempt_message, preempted_end_line, preemptible_lines
from gpuresa.mail.release import release_message, released_end_line
from gpuresa.mail.smtp import Notifier
from gpuresa.mail.wording import one_line
from gpuresa.model import Rejection, Session, SessionSpec
from gpuresa.outputs.messages import end_details, session_capabilities, start_details
from gpuresa.writeback.notes import CalendarNotes

log = logging.getLogger(__name__)


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


@dataclass
class Notices:
    """The daemon's notices, queued in the outbox; nothing here waits on SMTP."""

    config: Config
    notifier: Notifier
    outbox: Outbox
    # each state also written back into the booking's calendar, where that is on
    calendar: CalendarNotes | None = None

    @property
    def _timezone(self) -> str:
        return self.config.reservations.timezone

    def _public_host(self) -> str:
        host = self.config.host()
        return host.public_name or host.name

    def _to_user(
        self, key: str, kind: str | None, user: str, email: str | None, message: tuple[str, str]
    ) -> bool:
        address = self.notifier.address_for(user, email)
        if address is None:
            return False
        subject, body = message
        return bool(self.outbox.enqueue(key, kind, address, subject, body))

    def to_admin(self, key: str, kind: str | None, subject: str, body: str) -> bool:
        """A report for the admin (notify.admin), once per (key, kind)."""
        log.warning("%s: %s", key, subject)
        admin = self.config.notify.admin
        if not admin:
            return False
        return bool(self.outbox.enqueue(key, kind, admin, f"{SUBJECT_PREFIX} {subject}", body))

    def start(self, session: Session, email: str | None) -> bool:
        """The start notice (SSH line, FTP details); again only when these details change.

        The FTP password goes only to an address the site configured for the
        login: one from the calendar is whoever wrote the booking, and may name
        any login. That address gets the notice without it (the session shows it).
        """
        kind = "start-" + _digest(session.ssh_port, session.ftp_port, session.ftp_password)
        configured = self.notifier.configured_address(session.user)
        message = start_message(
            session,
            # a scheduler's session listens on its node
            session.place or self._public_host(),
            self._timezone,
            details=self._start_details(session),
            password_in_mail=configured is not None,
            ftps=session_capabilities(self.config, session).ftp_sidecar,
            # the template's browser tools: each one's ssh -L line and URL with its token
            tools=start_tool_lines(self.config, session, session.place or self._public_host()),
        )
        if self.calendar is not None:
            self.calendar.running(session, session.place or self._public_host())
        return self._to_user(session.key, kind, session.user, email or session.email, message)

    def prepared(self, spec: SessionSpec) -> None:
        """A prepared session: no e-mail, only its calendar says so (where write-back is on)."""
        if self.calendar is not None:
            self.calendar.prepared(spec)

    def warning(self, session: Session, before: timedelta, end: datetime, now: datetime) -> None:
        kind = f"warning-{int(before.total_seconds())}-{end.isoformat()}"
        message = warning_message(session, end - now, self._timezone)
        self._to_user(session.key, kind, session.user, session.email, message)

    def _start_details(self, session: Session) -> str:
        """Host keys and the output service for the start notice; none if unreadable."""
        daemon = self.config.daemon
        preemption = (
            preemptible_lines(daemon.preempt_notice, daemon.preempt_signal)
            if session.preemptible
            else ""
        )
        try:
            return preemption + start_details(self.config, session, self._public_host())
        except OSError as error:
            log.error("%s: host keys left out of the start notice: %s", session.key, error)
            return preemption

    def output_notice(
        self, key: str, kind: str, user: str, email: str | None, message: tuple[str, str]
    ) -> bool:
        """A notice about outputs (removal, a full disk), once per (key, kind)."""
        return self._to_user(key, kind, user, email, message)

    def end(
        self,
        session: Session,
        preempted_at: datetime | None = None,
        released_at: datetime | None = None,
    ) -> None:
        """The end notice; `preempted_at`: when a preemptible session was stopped early,
        `released_at`: when one nobody logged into was released."""
        details = end_details(self.config, session, self._public_host(), datetime.now(UTC))
        early = preempted_at or released_at
        if early is not None:
            line = (preempted_end_line if preempted_at else released_end_line)(
                early, self._timezone
            )
            details = "\n" + line + details
            # it ended when it was stopped, not at the end it was booked for
            session = replace(session, end=early)
        message = end_message(session, session.output_dir, self._timezone, details=details)
        self._to_user(session.key, "end", session.user, session.email, message)
        if self.calendar is not None:
            how = "preempted" if preempted_at else "released" if released_at else "ended"
            self.calendar.ended(session, early or datetime.now(UTC), how)

    def preempted(self, session: Session, stop_at: datetime, signal_name: str) -> None:
        """A preemptible session must give its GPUs up at `stop_at`."""
        message = preempt_message(session, stop_at, signal_name, self._timezone)
        self._to_user(session.key, "preempt", session.user, session.email, message)

    def release(self, session: Session, release_at: datetime, now: datetime) -> None:
        """A session nobody logged into is released at `release_at` unless used before."""
        message = release_message(session, release_at, now - session.start, self._timezone)
        self._to_user(session.key, "release", session.user, session.email, message)

    def cancelled(self, session: Session, stop_at: datetime) -> None:
        message = cancel_message(session, stop_at, self._timezone)
        self._to_user(session.key, "cancel", session.user, session.email, message)

    def reassigned(self, session: Session, new_user: str) -> None:
        """The old user of a booking that now names someone else: their session has ended."""
        subject = f"{SUBJECT_PREFIX} Your GPU session on {session.host} was stopped"
        body = f"""\
Hello {session.user},

the booking of your GPU session on {session.host} now names another login
({one_line(new_user, 40)}), so your session was stopped.

What you saved in the session's output folder is kept on {session.host} in:

  {session.output_dir}

If this is a mistake, ask whoever manages the booking to change it back.

Reservation: {one_line(session.key)}
"""
        self._to_user(
            session.key, f"reassigned-{new_user}", session.user, session.email, (subject, body)
        )

    def change_refused(self, key: str, user: str, email: str | None, change: str) -> None:
        """A running session keeps what it started with; its user learns the change waits."""
        subject = f"{SUBJECT_PREFIX} Your running session keeps its settings"
        body = f"""\
Hello {user},

the booking of your running GPU session changed ({one_line(change, 200)}).
A running session keeps the template and GPUs it started with: changing
them would mean new containers, and your running processes would be lost.

To use the new settings, end this booking and make a new one (or wait for
the next one): it starts with what the booking says.

Reservation: {one_line(key)}
"""
        self._to_user(key, f"change-{_digest(change)}", user, email, (subject, body))

    def failure(self, key: str, user: str, email: str | None, reason: str) -> None:
        """A booking that cannot be served: its user (admin in copy), once per key."""
        if self.calendar is not None:
            self.calendar.failed(key, reason)
        subject, body = failure_message(key, user, reason, host=self.config.daemon.host)
        address = self.notifier.address_for(user, email) if user else None
        if address is not None:
            self.outbox.enqueue(key, "failed", address, subject, body, copy_admin=True)
        elif self.config.notify.admin:
            self.outbox.enqueue(key, "failed", self.config.notify.admin, subject, body)

    def rejected(self, rejection: Rejection) -> None:
        """A booking rejected with a reason: its user, once per reason (and its calendar)."""
        if self.calendar is not None:
            self.calendar.refused(rejection)
        if rejection.user is None and rejection.email is None:
            return
        message = rejection_message(rejection, self._timezone)
        kind = "rejected-" + _digest(rejection.reason)
        self._to_user(rejection.key, kind, rejection.user or "", rejection.email, message)

    # --- what watching the GPUs found (gpuresa.gpus.findings) ---------------------------

    def _gpu_notice(
        self, key: str, kind: str, user: str, email: str | None, what: str, text: str
    ) -> None:
        subject = f"{SUBJECT_PREFIX} Your GPU session on {self.config.daemon.host} {what}"
        body = f"Hello {user},\n\n{text}\n\nReservation: {one_line(key)}\n"
        self._to_user(key, kind, user, email, (subject, body))

    def idle(self, finding: IdleBooking) -> None:
        """A booking whose GPUs stayed idle: its user (and the admin for "notify-admin"), once."""
        self._gpu_notice(
            finding.key, "idle", finding.user, finding.email, "has idle GPUs", finding.text()
        )
        if finding.audience == "user+admin":
            self.to_admin(
                finding.key,
                "idle-admin",
                f"idle GPUs in {one_line(finding.key, 80)}",
                finding.text(),
            )

    def unbooked(self, finding: UnbookedProcess) -> None:
        """A process on a GPU outside the sessions that hold it: the admin, once per process."""
        self.to_admin(
            f"unbooked:{finding.gpu_uuid}",
            f"pid-{finding.pid}",
            f"process {finding.pid} on GPU {finding.gpu_index} outside its booking",
            finding.text() + "\n",
        )

    def lost_in_session(self, finding: GpuLostInSession, recreated: bool) -> None:
        """A session's container that lost its GPUs: the user if it is recreated, else the admin."""
        if recreated:
            kind = f"recreated-{finding.container_id[:12]}"
            self._gpu_notice(
                finding.key, kind, finding.user, finding.email, "was recreated", finding.text()
            )
            return
        self.to_admin(
            finding.key,
            f"lost-{finding.container_id[:12]}",
            f"session {one_line(finding.key, 80)} lost access to its GPUs",
            f"{finding.text()}\n\nThe session was left as it is: [telemetry] recreate_lost "
            "is off, or it was recreated once already and its new containers cannot open "
            "the GPUs either (look at the host's device cgroup rules).\n",
        )

    def lost_from_host(self, finding: GpuLostFromHost, holders: list[Session]) -> None:
        """A GPU gone from the host: each holding session's user and the admin, once per GPU."""
        kind = f"gone-{finding.gpu_uuid}"
        for session in holders:
            text = (
                f"GPU {finding.gpu_index} of your session {session.key} is no longer visible on "
                f"{session.host} (it fell off the bus or its driver was reset). The session "
                "keeps its booking, but will not be started again on that GPU; processes "
                "that used it have most likely failed. Your output folder is unchanged."
            )
            self._gpu_notice(session.key, kind, session.user, session.email, "lost a GPU", text)
        self.to_admin(
            f"gpu:{finding.gpu_uuid}",
            kind,
            f"GPU {finding.gpu_index} is gone from {self.config.daemon.host}",
            f"{finding.text()}\n\nIt is left out of planning until the host shows it again.\n",
        )
