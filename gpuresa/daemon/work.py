"""What each action does, run on a worker thread: Docker, then the journal, then the outbox.

Nothing here decides, and nothing here touches the loop's memory: each
function returns what happened (or raises), and the loop updates its memory
from that on its own thread. Every function is safe to run at the same time
as the others for other sessions.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from datetime import datetime

from gpuresa.config.sections import Config
from gpuresa.daemon.memory import PREEMPTED, RELEASED
from gpuresa.daemon.notices import Notices
from gpuresa.daemon.records import session_from_record, session_record
from gpuresa.journal.store import Journal
from gpuresa.mail.notices import wall_text
from gpuresa.mail.preemption import preempt_wall_text
from gpuresa.mail.release import release_wall_text
from gpuresa.model import Session, SessionSpec
from gpuresa.planning.actions import (
    Extend,
    Fail,
    NotifyCancel,
    NotifyChange,
    NotifyPreempt,
    NotifyRelease,
    Prepare,
    Recreate,
    Start,
    Stop,
    Warn,
)
from gpuresa.sessions.errors import ImageMissing
from gpuresa.sessions.protocol import SessionBackend

log = logging.getLogger(__name__)

# Stops whose user is told the session ended, even when a restart interrupts them.
ENDS_TOLD = ("ended", "cancelled", "reassigned", "preempted", "released")
# The journal meta of a stop under way, with its reason (see `Work.finish_unwinding`).
UNWINDING = "unwinding:"

# What a stop turns the journal state into, by the stop's reason.
FINAL_STATE = {
    "ended": "ended",
    "cancelled": "cancelled",
    "orphan": "removed",
    # a prepared session that no longer fits its booking: prepared again later
    "replan": "booked",
    # the booking now names another login: the new user's session starts later
    "reassigned": "booked",
    # a preemptible session that gave its GPUs to a firm booking: done, output kept
    "preempted": "preempted",
    # a firm session nobody logged into in time: done, output kept, its GPUs free
    "released": "released",
}
# stops after which a booking is done for good (never started again), with the journal
# fact that says so
DONE_FOR_GOOD = {"preempted": PREEMPTED, "released": RELEASED}


@dataclass(frozen=True)
class Started:
    """A start that finished: the session runs (SSH and FTP answer)."""

    session: Session


@dataclass(frozen=True)
class Done:
    """An action that finished with nothing more to report."""


@dataclass
class Work:
    """The actions' side effects, with the config, runtime and notices of one moment.

    A reload makes a new `Work`; actions already under way finish with the old one.
    """

    config: Config
    runtime: SessionBackend
    journal: Journal
    notices: Notices

    # --- starting ---------------------------------------------------------------------

    def _require_image(self, spec: SessionSpec) -> None:
        """Raise `ImageMissing` when the session's image is not here yet (never builds)."""
        if not self.runtime.provisioned(spec.template, spec.cuda):
            raise ImageMissing(
                f"the image of {spec.template} (CUDA {spec.cuda or 'default'}) is being built",
                spec.template,
                spec.cuda,
            )

    def prepare(self, action: Prepare, now: datetime) -> Done:
        assert action.spec is not None
        self._require_image(action.spec)
        self.journal.states.set(action.key, "preparing", now)
        self.runtime.prepare(action.spec)
        self.notices.prepared(action.spec)
        return Done()

    def start(self, action: Start | Recreate, before: Session | None, now: datetime) -> Started:
        spec = action.spec
        assert spec is not None
        if before is None or before.state != "created":
            self._require_image(spec)
        if isinstance(action, Recreate):
            # start what is down (often only the FTP sidecar): the user's processes in a
            # running main container go on
            log.warning("%s: a container exited before the end; starting it again", spec.key)
        self.journal.states.set(spec.key, "preparing", now)
        session = self.runtime.start(spec)
        self.journal.states.set(spec.key, "running", now, f"ssh port {session.ssh_port}")
        self.notices.start(session, spec.email)
        return Started(session)

    # --- stopping ---------------------------------------------------------------------

    def stop(
        self, action: Stop, session: Session | None, new_user: str | None, now: datetime
    ) -> Done:
        key = action.key
        self.journal.states.set(key, "stopping", now, action.reason)
        # should this stop be cut short once the containers are gone, the next round
        # removes what is left (the network, the session's files): see `finish_unwinding`
        self.journal.facts.set(f"{UNWINDING}{key}", action.reason)
        told = session is not None and session.state != "created"
        if told and session is not None and action.reason in ENDS_TOLD:
            # what the end notice needs, should a restart interrupt this stop
            self.journal.facts.set(f"stopping:{key}", session_record(session, action.reason))
        if action.reason in DONE_FOR_GOOD:
            # done for good: never started again, whatever its state says later
            self.journal.facts.set(DONE_FOR_GOOD[action.reason] + key, now.isoformat())
        self.runtime.stop(key, action.grace)
        self.journal.states.set(key, FINAL_STATE[action.reason], now, action.reason)
        self.journal.facts.delete(f"missing:{key}")
        if session is not None and told and action.reason != "orphan":
            if action.reason == "reassigned":
                self.notices.reassigned(session, new_user or "another login")
            elif action.reason == "preempted":
                self.notices.end(session, preempted_at=now)
            elif action.reason == "released":
                self.notices.end(session, released_at=now)
            elif action.reason != "replan":
                self.notices.end(session)
        self.journal.facts.delete(f"stopping:{key}")
        self.journal.facts.delete(f"{UNWINDING}{key}")
        return Done()

    def finish_unwinding(self, key: str, reason: str, now: datetime) -> Done:
        """A stop cut short (a crash, a kill) after its containers went: the rest goes now.

        Removes the session's network and files, which the engine's removal of
        the containers leaves, and sets the journal state the stop would have
        (`reason`: the stop's). Idempotent. Raises what the engine raises.
        """
        self.runtime.kill(key)
        if self.journal.states.get(key) == "stopping":
            final = FINAL_STATE.get(reason, "ended")
            self.journal.states.set(key, final, now, f"{reason} (finished after an interruption)")
        self.journal.facts.delete(f"{UNWINDING}{key}")
        return Done()

    def kill(self, key: str) -> Done:
        """A stop that overran its deadline: everything of the session goes now."""
        self.runtime.kill(key)
        return Done()

    def end_main(self, key: str) -> Done:
        """A session whose container lost its GPUs: its main container goes, to be made again."""
        self.runtime.reset(key)
        return Done()

    def finish_interrupted_stop(self, key: str, record: str, now: datetime) -> Done:
        """A stop a restart cut short after the containers went: hand-over and end notice."""
        try:
            session, reason = session_from_record(record)
        except (ValueError, KeyError, TypeError):
            log.error("%s: unreadable record of an interrupted stop; dropped", key)
            self.journal.facts.delete(f"stopping:{key}")
            return Done()
        log.info("%s: finishing a stop that a restart interrupted", key)
        self.runtime.kill(key)  # the network and files a stop cut short leaves
        self.runtime.finish_stop(session)
        final = reason if reason in ("cancelled", "preempted", "released") else "ended"
        self.journal.states.set(key, final, now, f"{reason} (finished after a restart)")
        if reason != "reassigned":
            self.notices.end(
                session,
                preempted_at=now if reason == "preempted" else None,
                released_at=now if reason == "released" else None,
            )
        self.journal.facts.delete(f"stopping:{key}")
        self.journal.facts.delete(f"{UNWINDING}{key}")
        return Done()

    # --- during a session ---------------------------------------------------------------

    def extend(self, action: Extend) -> Done:
        self.runtime.extend(action.key, action.end)
        return Done()

    def warn(self, action: Warn, session: Session | None, now: datetime) -> Done:
        """The warning before the end: inside the session (best effort) and by e-mail."""
        self.journal.states.set(action.key, "warned", now, action.describe())
        if session is None:
            return Done()
        timezone = self.config.reservations.timezone
        self.notices.warning(session, action.before, action.end, now)
        self.runtime.message(action.key, wall_text(action.end - now, action.end, timezone))
        return Done()

    def notify_preempt(self, action: NotifyPreempt, session: Session | None, now: datetime) -> Done:
        """A preemptible session must give its GPUs up at `stop_at`: told in the session (best
        effort), by e-mail, and with the site's signal to its processes (for a checkpoint)."""
        if session is None:
            return Done()
        timezone = self.config.reservations.timezone
        daemon = self.config.daemon
        self.notices.preempted(session, action.stop_at, daemon.preempt_signal)
        self.runtime.message(
            action.key, preempt_wall_text(action.stop_at - now, action.stop_at, timezone)
        )
        sent = self.runtime.signal(action.key, signal.Signals[daemon.preempt_signal])
        log.info("%s: %s sent to %d process(es)", action.key, daemon.preempt_signal, sent)
        return Done()

    def notify_release(self, action: NotifyRelease, session: Session | None, now: datetime) -> Done:
        """Nobody logged into the session: it is released at `release_at` unless used; told
        in the session (best effort) and by e-mail."""
        if session is None:
            return Done()
        timezone = self.config.reservations.timezone
        self.notices.release(session, action.release_at, now)
        text = release_wall_text(action.release_at - now, action.release_at, timezone)
        self.runtime.message(action.key, text)
        return Done()

    def notify_cancel(self, action: NotifyCancel, session: Session | None, now: datetime) -> Done:
        if session is None:
            return Done()
        timezone = self.config.reservations.timezone
        self.notices.cancelled(session, action.stop_at)
        self.runtime.message(action.key, wall_text(action.stop_at - now, action.stop_at, timezone))
        return Done()

    def notify_change(self, action: NotifyChange) -> Done:
        self.notices.change_refused(action.key, action.user, action.email, action.change)
        return Done()

    def fail(self, action: Fail, now: datetime) -> Done:
        self.journal.states.set(action.key, "failed", now, action.reason)
        log.error("%s: cannot be served: %s", action.key, action.reason)
        self.notices.failure(action.key, action.user, action.email, action.reason)
        return Done()

    def build(self, template: str | None, cuda: str | None) -> Done:
        """Build an image (the FTP sidecar's for `template` None): minutes, on its own thread."""
        self.runtime.provision(template, cuda)
        return Done()
