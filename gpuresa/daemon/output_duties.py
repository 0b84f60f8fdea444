"""What the daemon does for outputs each maintenance round, in one call on a worker thread.

`OutputDuties.run(now, sessions, to_user, to_admin)` keeps the output service
running, sends the removal notices that are due, removes what is past its
retention, and tells users and the admin about the output disk. Mail goes
through the two callables (the daemon's outbox, which deduplicates by
(key, kind)), so nothing here talks to SMTP; the kinds below are chosen so
that each notice goes out once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuresa.backends.engines.output_service import OutputService
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.homes.retention import review as review_homes
from gpuresa.mail.wording import format_remaining
from gpuresa.model import Session
from gpuresa.outputs.disk import DiskState, Level
from gpuresa.outputs.handover import retry_pending
from gpuresa.outputs.messages import (
    disk_admin_message,
    disk_warning_message,
    removal_notice_message,
)
from gpuresa.outputs.records import image_relative
from gpuresa.sessions.errors import RuntimeUnavailable, SessionError

log = logging.getLogger(__name__)

# an output record younger than this may be a session being made: not a leftover yet
PENDING_SETTLE = timedelta(minutes=10)

# (key, kind, login, booking's e-mail, (subject, body)) -> queued
ToUser = Callable[[str, str, str, "str | None", tuple[str, str]], bool]
# (key, kind, subject, body) -> queued; the subject has no "[gpuresa]" prefix (the
# daemon's admin notices add it)
ToAdmin = Callable[[str, str, str, str], bool]


@dataclass
class OutputDuties:
    """The outputs' share of the daemon's rounds; remembers the disk's last level."""

    service: OutputService
    # the name users connect to; "" for [[hosts]].public_name, else the host's name
    public_host: str = ""
    last_level: Level = "ok"

    def _public_host(self) -> str:
        if self.public_host:
            return self.public_host
        config = self.service.config
        try:
            host = config.host()
        except UserError:
            return config.daemon.host
        return host.public_name or host.name

    def run(
        self, now: datetime, sessions: Sequence[Session], to_user: ToUser, to_admin: ToAdmin
    ) -> str:
        """One round; returns a line for the log. Never raises: each part logs its failure."""
        parts = []
        try:
            state = self.service.ensure_running()
            parts.append(f"output service {state.action}")
        except (SessionError, RuntimeUnavailable, OSError) as error:
            log.error("the output service is not running: %s", error)
            parts.append("output service DOWN")
        parts.append(self._hand_overs(now, sessions, to_user, to_admin))
        try:
            parts.append(self._notices_and_removals(now, to_user))
        except (RuntimeUnavailable, OSError) as error:
            log.error("output retention skipped this round: %s", error)
        try:
            parts.append(review_homes(self.service.config, now, to_user))
        except OSError as error:
            log.error("homes' retention skipped this round: %s", error)
        try:
            disk = self.service.disk_state()
            self._disk(disk, now, sessions, to_user, to_admin)
            parts.append(disk.summary)
        except OSError as error:
            log.error("cannot measure the output disk: %s", error)
        return "; ".join(parts)

    def _hand_overs(
        self, now: datetime, sessions: Sequence[Session], to_user: ToUser, to_admin: ToAdmin
    ) -> str:
        """Retry the hand-overs that failed (their outputs wait where only root reaches them)."""
        config = self.service.config
        failed: list[str] = []

        def report(key: str, problem: str) -> None:
            failed.append(key)
            subject = f"output of {key} not handed over on {config.daemon.host}"
            body = (
                f"The output of session {key} could not be handed to its owner: {problem}.\n"
                "It stays where only root can reach it, and gpuresa tries again every round.\n"
            )
            to_admin(key, "output-hand-over", subject, body)
            kept = self.service.records.read(image_relative(key))
            if kept and kept.get("image"):
                to_user(key, "output-in-image", kept["user"], None, _in_image_message(key, config))

        try:
            live = {session.key for session in sessions}
            done = retry_pending(config, live, report, now, settle=PENDING_SETTLE)
        except OSError as error:
            log.error("hand-overs not retried this round: %s", error)
            return "hand-overs not retried"
        parts = [f"{done} hand-over(s) finished late"] if done else []
        if failed:
            parts.append(f"{len(failed)} hand-over(s) failing ({', '.join(failed)})")
        return "; ".join(parts) or "no hand-over pending"

    def _notices_and_removals(self, now: datetime, to_user: ToUser) -> str:
        storage = self.service.config.storage
        noticed = 0
        for folder in self.service.due_removal_notices(now):
            removal = folder.removal(storage)
            if removal is None:
                continue
            # the notice is due N before `removal`; sent late, the removal moves to now + N
            removal = max(removal, now + storage.output_removal_notice)
            message = removal_notice_message(
                folder, self.service.config, self._public_host(), removal
            )
            to_user(folder.relative, "output-removal", folder.user, None, message)
            # queued (or nobody to tell): the outbox delivers it, the clock starts now
            self.service.notice_sent(folder, now)
            noticed += 1
        removed = self.service.prune(now)
        return f"{noticed} removal notice(s), {len(removed)} output(s) removed"

    def _disk(
        self,
        disk: DiskState,
        now: datetime,
        sessions: Sequence[Session],
        to_user: ToUser,
        to_admin: ToAdmin,
    ) -> None:
        host = self.service.config.daemon.host
        if disk.level != "ok":
            log.warning("output disk: %s (%s)", disk.summary, disk.level)
            for session in sessions:
                if session.state == "running":
                    message = disk_warning_message(session, disk, host)
                    to_user(session.key, "output-disk-low", session.user, session.email, message)
        if disk.level != self.last_level and disk.level != "ok":
            subject, body = disk_admin_message(disk, host)
            to_admin("output-disk", f"{disk.level}-{now:%Y-%m-%d}", subject, body)
        self.last_level = disk.level


def _in_image_message(key: str, config: Config) -> tuple[str, str]:
    """What a user is told once when their output cannot be copied out of its capped image."""
    retention = config.storage.output_retention
    kept = (
        "kept until an administrator removes it"
        if retention == "forever"
        else f"kept {format_remaining(retention)} after the end of your session"
    )
    subject = f"the output of session {key} is not available yet"
    body = (
        f"The output of your session {key} on {config.daemon.host} could not be copied out "
        "of its capped image, so it cannot be downloaded for now. The administrator is told, "
        "and gpuresa tries again every few minutes. Like any output, it is "
        f"{kept}, then removed with its image.\n"
    )
    return subject, body
