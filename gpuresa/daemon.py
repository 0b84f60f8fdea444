"""The service: poll the calendars, plan, carry the actions out, on time, for months.

Wiring only: decisions are `gpuresa.plan`'s, Docker is `gpuresa.runtime`'s,
e-mail is `gpuresa.notify`'s. One lock serialises every reconcile, so the
poll, the exact-time triggers and the retries never act on the same session at
once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import fcntl
import json
import logging
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import IO, TypeVar

from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler

from gpuresa import systemd
from gpuresa.calendars import CalendarReport, Calendars
from gpuresa.config import Config, load_config
from gpuresa.errors import UserError
from gpuresa.journal import Journal
from gpuresa.model import Rejection, Reservation, Session, SessionSpec
from gpuresa.notify import (
    Notifier,
    NotifyError,
    cancel_message,
    end_message,
    failure_message,
    rejection_message,
    start_message,
    wall_text,
    warning_message,
)
from gpuresa.plan import (
    Action,
    Extend,
    Fail,
    Inventory,
    Memory,
    NotifyCancel,
    Prepare,
    Recreate,
    Start,
    Stop,
    Warn,
    plan,
    wakeups,
)
from gpuresa.runtime import Runtime, RuntimeUnavailable

log = logging.getLogger(__name__)

# A failed start is retried after these delays (then every last one).
# How often a session waiting for its image's build looks again (a finished build
# also wakes the daemon at once).
IMAGE_WAIT = timedelta(seconds=10)

# Stops carried out at once, each waiting up to its grace period.
MAX_PARALLEL_STOPS = 8

# A start notice that could not be sent is tried again after this long.
NOTICE_RETRY = timedelta(minutes=5)

# With no poll or action finished for this long, the daemon counts as stuck.
STUCK_AFTER = timedelta(minutes=30)

RETRY_DELAYS = (timedelta(seconds=15), timedelta(seconds=60), timedelta(minutes=5))


class GuardedJournal(Journal):
    """The journal, with writes that log their failure instead of raising.

    A full disk or a broken database must not keep sessions running past their
    end: the daemon acts on Docker first and records what it can. A notice whose
    claim cannot be recorded is sent (twice is better than never).
    """

    def set_state(self, key: str, state: str, now: datetime, detail: str = "") -> bool:
        return _best_effort(
            lambda: super(GuardedJournal, self).set_state(key, state, now, detail), False
        )

    def record_action(
        self, key: str, action: str, now: datetime, result: str, error: str | None = None
    ) -> None:
        _best_effort(
            lambda: super(GuardedJournal, self).record_action(key, action, now, result, error),
            None,
        )

    def mark_notified(self, key: str, kind: str, now: datetime) -> bool:
        return _best_effort(lambda: super(GuardedJournal, self).mark_notified(key, kind, now), True)

    def unmark_notified(self, key: str, kind: str) -> None:
        _best_effort(lambda: super(GuardedJournal, self).unmark_notified(key, kind), None)

    def set_meta(self, name: str, value: str) -> None:
        _best_effort(lambda: super(GuardedJournal, self).set_meta(name, value), None)

    def delete_meta(self, name: str) -> None:
        _best_effort(lambda: super(GuardedJournal, self).delete_meta(name), None)

    def record_calendar(
        self, name: str, last_success: datetime | None, last_error: str | None, now: datetime
    ) -> None:
        _best_effort(
            lambda: super(GuardedJournal, self).record_calendar(
                name, last_success, last_error, now
            ),
            None,
        )


Result = TypeVar("Result")


def _best_effort(call: Callable[[], Result], fallback: Result) -> Result:
    try:
        return call()
    except sqlite3.Error as error:
        log.error("journal write failed (%s); going on without it", error)
        return fallback


def session_record(session: Session, reason: str) -> str:
    """A session and why it stops, as JSON for the journal."""
    record = {field.name: getattr(session, field.name) for field in dataclasses.fields(session)}
    record.update(
        gpus=list(session.gpus),
        containers=list(session.containers),
        start=session.start.isoformat(),
        end=session.end.isoformat(),
        output_dir=str(session.output_dir),
        ftp_password="",  # not needed after the end, not worth keeping
        id_range=None,  # the engine's to tell; finishing a stop does not need it
        reason=reason,
    )
    return json.dumps(record)


def session_from_record(text: str) -> tuple[Session, str]:
    """The session and reason `session_record` wrote; raises ValueError/KeyError/TypeError."""
    record = json.loads(text)
    reason = str(record.pop("reason"))
    record.update(
        gpus=tuple(record["gpus"]),
        containers=tuple(record["containers"]),
        start=datetime.fromisoformat(record["start"]),
        end=datetime.fromisoformat(record["end"]),
        output_dir=Path(record["output_dir"]),
    )
    return Session(**record), reason


def utc_now() -> datetime:
    return datetime.now(UTC)


def journal_path(config: Config) -> Path:
    return config.daemon.state_dir / "journal.sqlite"


@dataclass
class Remembered:
    """What the daemon keeps between rounds, mirrored in the journal where a restart needs it."""

    missing_since: dict[str, datetime] = field(default_factory=dict)
    warnings_sent: set[tuple[str, int]] = field(default_factory=set)
    cancel_notified: set[str] = field(default_factory=set)
    retry_after: dict[str, datetime] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    notice_retry_after: dict[str, datetime] = field(default_factory=dict)


class Daemon:
    """gpuresa's main loop. `run()` blocks until SIGTERM/SIGINT; sessions outlive it."""

    def __init__(
        self,
        config: Config,
        *,
        runtime: Runtime | None = None,
        clock: Callable[[], datetime] = utc_now,
        on_start: Callable[[Session, str], None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.runtime = runtime or Runtime(config)
        self.calendars = Calendars(config)
        self.notifier = Notifier(config.notify, config.users)
        self.journal: Journal = GuardedJournal(journal_path(config))
        self.on_start = on_start
        self.lock = threading.RLock()
        self.reservations: list[Reservation] = []
        self.remembered = Remembered()
        self._load_missing_since()
        self.scheduler = BackgroundScheduler(timezone=UTC, job_defaults={"coalesce": True})
        self.stopping = threading.Event()
        self.docker_backoff = timedelta(seconds=1)
        # monotonic time of the last sign of progress (a poll or an action), for the watchdog
        self.heartbeat = time.monotonic()
        self.reload_requested = threading.Event()
        self.lock_file: IO[str] | None = None
        # image builds, one at a time, outside the reconcile lock
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuresa-build")
        self.builds: dict[tuple[str, str | None], Future[str]] = {}
        self.image_waiting: set[str] = set()
        # set by the signal handlers, so the main loop acts at once rather than at its next beat
        self.wake = threading.Event()

    # --- life cycle ----------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT; SIGHUP reloads the config."""
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_reload_signal)
        # `kill -USR1` prints every thread's stack to the log: how to see what a hung daemon does
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.start()
        systemd.ready(f"watching {len(self.config.calendars)} calendar(s)")
        interval = systemd.watchdog_interval()
        beat = min(interval / 2, 10.0) if interval else 10.0
        try:
            while not self.stopping.is_set():
                self.wake.wait(beat)
                self.wake.clear()
                if self.stopping.is_set():
                    break
                if self.reload_requested.is_set():
                    self.reload_requested.clear()
                    # in a job: the main thread must keep feeding the watchdog while a
                    # long reconcile holds the lock the reload needs
                    self.scheduler.add_job(self.reload, id="reload", replace_existing=True)
                self._feed_watchdog()
        finally:
            systemd.stopping()
            self.shutdown()

    def start(self) -> None:
        """Take the state directory's lock, then start the poll; sessions are adopted there.

        Raises `UserError` when another daemon already uses the state directory:
        two daemons would start the same sessions and remove each other's.
        """
        lock_path = self.config.daemon.state_dir / "daemon.lock"
        self.lock_file = lock_path.open("a+")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.close()
            other = self.journal.get_meta("daemon_pid") or "?"
            raise UserError(
                f"another gpuresa daemon (pid {other}) uses {self.config.daemon.state_dir}; "
                "stop it first (systemctl stop gpuresa)"
            ) from None
        self.journal.set_meta("daemon_pid", str(os.getpid()))
        self.scheduler.add_job(
            self.poll,
            "interval",
            seconds=self.config.daemon.poll_interval.total_seconds(),
            id="poll",
            next_run_time=datetime.now(UTC),
            max_instances=1,
        )
        self.scheduler.start()
        log.info(
            "gpuresa started for host %s: %d calendar(s), polled every %ss",
            self.config.daemon.host,
            len(self.config.calendars),
            int(self.config.daemon.poll_interval.total_seconds()),
        )

    def shutdown(self) -> None:
        """Stop the jobs and close the journal; running sessions go on in Docker."""
        log.info("gpuresa stopping; running sessions go on and will be adopted at the next start")
        self.stopping.set()
        # not wait=True: APScheduler would hold its job-store lock while a running
        # reconcile needs it to reschedule; the reconcile lock waits for it instead
        self.scheduler.shutdown(wait=False)
        self.builder.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self.journal.close()
        if self.lock_file is not None:
            self.lock_file.close()  # releases the state directory's lock

    def _on_stop_signal(self, number: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(number).name)
        self.stopping.set()
        self.wake.set()

    def _on_reload_signal(self, number: int, frame: FrameType | None) -> None:
        self.reload_requested.set()
        self.wake.set()

    def reload(self) -> None:
        """Read the config file again; a bad file is logged and the old config kept."""
        path = self.config.source
        try:
            config = load_config(path)
        except UserError as error:
            log.error("reload refused, keeping the running config: %s", error)
            return
        with self.lock:
            self.config = config
            self.runtime = Runtime(config)
            self.calendars = Calendars(config)
            self.notifier = Notifier(config.notify, config.users)
        self.scheduler.reschedule_job(
            "poll", trigger="interval", seconds=config.daemon.poll_interval.total_seconds()
        )
        log.info("configuration reloaded from %s", path)
        self.scheduler.add_job(self.poll, id="poll-after-reload", replace_existing=True)

    # --- rounds ------------------------------------------------------------------------

    def _feed_watchdog(self) -> None:
        """Tell systemd we are alive, unless no round has made progress for too long.

        The limit is generous: a first image build of an upstream template may take
        many minutes and holds the reconcile lock the whole time.
        """
        silent = time.monotonic() - self.heartbeat
        if silent < STUCK_AFTER.total_seconds():
            systemd.watchdog()
        else:
            log.error(
                "no poll or action finished for %d s; letting the watchdog restart us", silent
            )

    def poll(self) -> None:
        """Read the calendars (or their last snapshot), journal what changed, reconcile."""
        self.heartbeat = time.monotonic()
        now = self.clock()
        try:
            report = self.calendars.poll(now)
        except Exception:  # a bug in a source must not stop the daemon's other work
            log.exception("calendar poll failed unexpectedly; keeping the last reservations")
        else:
            self._take_report(report, now)
        self.reconcile("poll")
        self.heartbeat = time.monotonic()

    def _take_report(self, report: CalendarReport, now: datetime) -> None:
        host = self.config.daemon.host
        found = report.reservations
        with self.lock:
            if self.stopping.is_set():
                return
            self.reservations = [item for item in found.reservations if item.host == host]
            new_rejections = self.journal.record_reservations(
                found.reservations, found.rejected, now
            )
            for reservation in self.reservations:
                if self.journal.state(reservation.key) in (None, "rejected"):
                    self.journal.set_state(reservation.key, "booked", now)
            for name, freshness in report.freshness.items():
                self.journal.record_calendar(
                    name, freshness.last_success, freshness.last_error, now
                )
        for rejection in new_rejections:
            self._reject(rejection, now)
        stale = [
            f"{name} ({freshness.last_error})"
            for name, freshness in report.freshness.items()
            if freshness.last_error
        ]
        if stale:
            systemd.status(f"calendar unreachable, using the last snapshot: {', '.join(stale)}")
        else:
            systemd.status(f"{len(self.reservations)} reservation(s) for {host}")

    def _reject(self, rejection: Rejection, now: datetime) -> None:
        """Journal a rejection and tell its user, once per reason."""
        calendar = next(
            (item for item in self.config.calendars if item.name == rejection.calendar), None
        )
        if calendar is not None and calendar.host not in (None, self.config.daemon.host):
            return  # that host's daemon tells the user
        # a calendar whose events name their host (LOCATION) is read by every host's
        # daemon: the first host in the config speaks for all, so users get one e-mail
        speaks_for_all = (
            not self.config.hosts or self.config.daemon.host == self.config.hosts[0].name
        )
        self.journal.set_state(rejection.key, "rejected", now, rejection.reason)
        if calendar is not None and calendar.host is None and not speaks_for_all:
            return
        log.warning("%s: rejected: %s", rejection.key, rejection.reason)
        if rejection.user is None and rejection.email is None:
            return
        address = self.notifier.address_for(rejection.user or "", rejection.email)
        if address is None:
            return
        subject, body = rejection_message(rejection, self.config.reservations.timezone)
        self._mail(rejection.key, address, subject, body)

    def reconcile(self, reason: str) -> None:
        """Compare reservations with Docker and act; reschedules the exact-time wakeups."""
        with self.lock:
            if self.stopping.is_set():
                return
            now = self.clock()
            try:
                sessions = self.runtime.list_sessions()
                # every round: with gpus = "auto", a driver that was not ready at boot is
                # seen once it is (the runtime caches what nvidia-smi says)
                inventory = Inventory(self.config.host(), self.runtime.host_gpus())
            except RuntimeUnavailable as error:
                self._docker_down(error)
                return
            self.docker_backoff = timedelta(seconds=1)
            self._finish_interrupted_stops(sessions, now)
            memory = self._memory(sessions, now)
            actions = plan(self.reservations, sessions, inventory, now, self.config, memory)
            if actions:
                log.debug("reconcile (%s): %s", reason, [action.describe() for action in actions])
            by_key = {session.key: session for session in sessions}
            stops = [action for action in actions if isinstance(action, Stop)]
            try:
                stop_failed = not self._stop_all(stops, by_key, now)
            except RuntimeUnavailable as error:
                self._docker_down(error)
                return
            for action in actions:
                if self.stopping.is_set():
                    return
                if isinstance(action, Stop):
                    continue
                if stop_failed and isinstance(action, (Start, Recreate, Prepare)):
                    # a session that would not stop may still hold the GPUs and ports
                    # this one was given; the next round plans with what really runs
                    log.warning("%s: postponed, a stop failed in this round", action.key)
                    continue
                try:
                    self._apply(action, by_key.get(action.key), now)
                except RuntimeUnavailable as error:
                    self._docker_down(error)
                    return
            self._owed_start_notices(sessions)
            # what the actions changed moves the next wakeups (a stop, a new end)
            sessions = self._sessions_or(sessions)
            self._schedule(
                wakeups(
                    self.reservations,
                    sessions,
                    inventory,
                    now,
                    self.config,
                    self._memory(sessions, now),
                )
            )

    def _stop_all(self, stops: list[Stop], by_key: dict[str, Session], now: datetime) -> bool:
        """Carry the stops out side by side; returns whether all succeeded.

        Side by side: each may wait its whole grace period for the user's
        processes, and eight sessions ending at 18:00 must all be gone by
        18:00 plus one grace, not eight.
        """
        if len(stops) <= 1:
            return all(self._apply(stop, by_key.get(stop.key), now) for stop in stops)
        with ThreadPoolExecutor(max_workers=min(len(stops), MAX_PARALLEL_STOPS)) as pool:
            done = list(pool.map(lambda stop: self._apply(stop, by_key.get(stop.key), now), stops))
        return all(done)

    def _sessions_or(self, fallback: list[Session]) -> list[Session]:
        try:
            return self.runtime.list_sessions()
        except RuntimeUnavailable:
            return fallback

    def _docker_down(self, error: Exception) -> None:
        if self.stopping.is_set():
            return
        delay = self.docker_backoff
        log.error("Docker engine unavailable (%s); retrying in %ss", error, delay.total_seconds())
        systemd.status(f"Docker unavailable, retrying in {int(delay.total_seconds())}s")
        self.docker_backoff = min(delay * 2, self.config.daemon.docker_retry_max)
        self.scheduler.add_job(
            self.reconcile,
            "date",
            run_date=datetime.now(UTC) + delay,
            args=["docker retry"],
            id="docker-retry",
            replace_existing=True,
        )

    def _schedule(self, instants: list[datetime]) -> None:
        """One date job per upcoming instant (replacing the previous set)."""
        if self.stopping.is_set():
            return
        wanted = {f"wake-{instant.isoformat()}": instant for instant in instants[:200]}
        for job in self.scheduler.get_jobs():
            if job.id.startswith("wake-") and job.id not in wanted:
                # it may have fired (and gone) between the listing and now
                with contextlib.suppress(JobLookupError):
                    job.remove()
        existing = {job.id for job in self.scheduler.get_jobs()}
        for job_id, instant in wanted.items():
            if job_id not in existing:
                self.scheduler.add_job(
                    self.reconcile,
                    "date",
                    run_date=instant,
                    args=["timer"],
                    id=job_id,
                    misfire_grace_time=None,
                )

    def _memory(self, sessions: list[Session], now: datetime) -> Memory:
        wanted = {reservation.key for reservation in self.reservations}
        remembered = self.remembered
        for session in sessions:
            if session.key not in wanted and session.key not in remembered.missing_since:
                remembered.missing_since[session.key] = now
                self.journal.set_meta(f"missing:{session.key}", now.isoformat())
        present = {session.key for session in sessions}
        for key in list(remembered.missing_since):
            if key in wanted or key not in present:
                del remembered.missing_since[key]
                self.journal.delete_meta(f"missing:{key}")
        for key in remembered.cancel_notified & wanted:
            # the booking came back: a later cancellation gets its own notice
            remembered.cancel_notified.discard(key)
            self.journal.unmark_notified(key, "cancel")
        known = frozenset(self.journal.states()) | frozenset(wanted)
        return Memory(
            missing_since=dict(remembered.missing_since),
            known=known,
            warnings_sent=frozenset(remembered.warnings_sent),
            cancel_notified=frozenset(remembered.cancel_notified),
            retry_after=dict(remembered.retry_after),
        )

    def _load_missing_since(self) -> None:
        """A restart keeps the grace periods that were running."""
        for key, value in self.journal.meta_with_prefix("missing:").items():
            if value:
                self.remembered.missing_since[key] = datetime.fromisoformat(value)

    # --- carrying actions out -----------------------------------------------------------

    def _apply(self, action: Action, session: Session | None, now: datetime) -> bool:
        """Carry one action out; returns whether it succeeded (failures are logged)."""
        key = action.key
        self.heartbeat = time.monotonic()
        log.info("%s", action.describe())
        try:
            spec = getattr(action, "spec", None)
            needs_image = isinstance(action, (Prepare, Recreate)) or (
                isinstance(action, Start) and (session is None or session.state != "created")
            )
            if needs_image and spec is not None and not self._image_ready(spec, now):
                self.remembered.retry_after[key] = now + IMAGE_WAIT
                self.image_waiting.add(key)
                return True
            if isinstance(action, Stop):
                self._stop(action, session, now)
            elif isinstance(action, Fail):
                self._fail(action, now)
            elif isinstance(action, (Start, Recreate)):
                self._start(action, session, now)
            elif isinstance(action, Prepare):
                assert action.spec is not None
                self.journal.set_state(key, "preparing", now)
                self.runtime.prepare(action.spec)
            elif isinstance(action, Extend):
                self.runtime.extend(key, action.end)
                self.remembered.warnings_sent = {
                    (sent_key, seconds)
                    for sent_key, seconds in self.remembered.warnings_sent
                    if sent_key != key or action.end - timedelta(seconds=seconds) <= now
                }
            elif isinstance(action, Warn):
                self._warn(action, session)
                self.journal.set_state(key, "warned", now, action.describe())
            elif isinstance(action, NotifyCancel):
                self._notify_cancel(action, session)
        except RuntimeUnavailable:
            self.journal.record_action(key, action.describe(), now, "failed", "Docker unavailable")
            raise
        except Exception as error:  # one session's failure must not stop the others
            log.exception("%s: %s failed", key, type(action).__name__.lower())
            self.journal.record_action(key, action.describe(), now, "failed", str(error))
            if isinstance(action, (Start, Recreate, Prepare)):
                self._retry_later(action, str(error), now)
            return False
        self.journal.record_action(key, action.describe(), now, "ok")
        return True

    def _image_ready(self, spec: SessionSpec, now: datetime) -> bool:
        """Whether the session's image is here; if not, it is built in the background.

        A first build (with the pull of an upstream image) can take many minutes;
        under the reconcile lock it would hold up every other session's start and
        stop. Raises the build's error once it has failed (the action then fails
        and is retried like any other).
        """
        wanted = (spec.template, spec.cuda)
        build = self.builds.get(wanted)
        if build is not None:
            if not build.done():
                return False
            del self.builds[wanted]
            build.result()
            return True
        if self.runtime.image_present(spec.template, spec.cuda):
            return True
        log.info(
            "%s: building the image of %s (CUDA %s) in the background",
            spec.key,
            spec.template,
            spec.cuda or "default",
        )
        build = self.builder.submit(self.runtime.ensure_image, spec.template, spec.cuda)
        build.add_done_callback(self._on_build_done)
        self.builds[wanted] = build
        return False

    def _on_build_done(self, build: Future[str]) -> None:
        if not self.stopping.is_set():
            self.scheduler.add_job(self._after_build, id="image-built", replace_existing=True)

    def _after_build(self) -> None:
        """A build finished: the sessions that waited for it go on at once."""
        with self.lock:
            for key in self.image_waiting:
                self.remembered.retry_after.pop(key, None)
            self.image_waiting.clear()
        self.reconcile("image built")

    def _start(self, action: Start | Recreate, before: Session | None, now: datetime) -> None:
        spec = action.spec
        assert spec is not None
        key = spec.key
        if isinstance(action, Recreate):
            # start what is down (often only the FTP sidecar): the user's processes in a
            # running main container go on; a start that fails removes the containers,
            # and the retry creates them afresh
            log.warning("%s: a container exited before the end; starting it again", key)
        self.journal.set_state(key, "preparing", now)
        session = self.runtime.start(spec)
        self.journal.set_state(key, "running", self.clock(), f"ssh port {session.ssh_port}")
        self.remembered.attempts.pop(key, None)
        self.remembered.retry_after.pop(key, None)
        if self.on_start is not None:
            self.on_start(session, self._public_host())
        if before is not None and (before.ftp_password, before.ssh_port) != (
            session.ftp_password,
            session.ssh_port,
        ):
            # new containers, new FTP password: the user needs the new details
            self.journal.unmark_notified(key, "start")
        self._start_notice(session, spec.email)

    def _public_host(self) -> str:
        host = self.config.host()
        return host.public_name or host.name

    def _start_notice(self, session: Session, email: str | None) -> None:
        """The start e-mail (SSH line, FTP details), once; retried later if sending fails."""
        key = session.key
        address = self.notifier.address_for(session.user, email or session.email)
        if address is None:
            return
        subject, body = start_message(
            session, self._public_host(), self.config.reservations.timezone
        )
        if not self._notice(key, "start", address, subject, body):
            self.remembered.notice_retry_after[key] = self.clock() + NOTICE_RETRY

    def _owed_start_notices(self, sessions: list[Session]) -> None:
        """Finish starts a restart interrupted: journal the running state, send the notice.

        Covers a daemon killed between starting the containers and e-mailing the
        user, and a start e-mail whose sending failed (retried every few minutes).
        """
        wanted = {reservation.key: reservation for reservation in self.reservations}
        now = self.clock()
        for session in sessions:
            reservation = wanted.get(session.key)
            if session.state != "running" or reservation is None:
                continue
            if "start" in self.journal.notified(session.key):
                continue
            if now < self.remembered.notice_retry_after.get(session.key, now):
                continue
            if self.journal.state(session.key) in (None, "booked", "preparing", "failed"):
                self.journal.set_state(session.key, "running", now, "adopted")
            self._start_notice(session, reservation.email)

    def _back_off(self, key: str, now: datetime) -> int:
        """Count one more failed attempt and delay the next; returns the attempt number."""
        attempts = self.remembered.attempts.get(key, 0) + 1
        self.remembered.attempts[key] = attempts
        delay = RETRY_DELAYS[min(attempts, len(RETRY_DELAYS)) - 1]
        self.remembered.retry_after[key] = now + delay
        return attempts

    def _failure_notice(
        self, key: str, user: str, email: str | None, reason: str, now: datetime
    ) -> None:
        """Tell the user (admin in copy) that a booking cannot be served, once per key."""
        if self.journal.mark_notified(key, "failed", now):
            subject, body = failure_message(key, user, reason, host=self.config.daemon.host)
            self._mail_failure(key, user, email, subject, body)

    def _retry_later(self, action: Action, error: str, now: datetime) -> None:
        key = action.key
        attempts = self._back_off(key, now)
        self.journal.set_state(key, "failed", now, f"attempt {attempts}: {error}")
        if attempts == 1:
            spec = getattr(action, "spec", None)
            user = spec.user if spec is not None else ""
            self._failure_notice(key, user, getattr(spec, "email", None), error, now)

    def _stop(self, action: Stop, session: Session | None, now: datetime) -> None:
        key = action.key
        self.journal.set_state(key, "stopping", now, action.reason)
        if (
            session is not None
            and session.state != "created"
            and action.reason in ("ended", "cancelled")
        ):
            # what the end notice needs, should a restart interrupt this stop
            self.journal.set_meta(f"stopping:{key}", session_record(session, action.reason))
        self.runtime.stop(key, action.grace)
        final = {
            "ended": "ended",
            "cancelled": "cancelled",
            "orphan": "removed",
            # a prepared session that no longer fits its booking: prepared again later
            "replan": "booked",
        }[action.reason]
        self.journal.set_state(key, final, self.clock(), action.reason)
        self.remembered.missing_since.pop(key, None)
        self.journal.delete_meta(f"missing:{key}")
        if session is None or session.state == "created" or action.reason == "orphan":
            return
        self._end_notice(session)
        self.journal.delete_meta(f"stopping:{key}")

    def _end_notice(self, session: Session) -> None:
        address = self.notifier.address_for(session.user, session.email)
        if address:
            subject, body = end_message(
                session, session.output_dir, self.config.reservations.timezone
            )
            self._notice(session.key, "end", address, subject, body)

    def _finish_interrupted_stops(self, sessions: list[Session], now: datetime) -> None:
        """Stops a restart cut short after the containers went: hand-over and end notice."""
        present = {session.key for session in sessions}
        for key, record in self.journal.meta_with_prefix("stopping:").items():
            if key in present:
                continue  # the planner stops it again
            try:
                session, reason = session_from_record(record)
            except (ValueError, KeyError, TypeError):
                log.error("%s: unreadable record of an interrupted stop; dropped", key)
                self.journal.delete_meta(f"stopping:{key}")
                continue
            log.info("%s: finishing a stop that a restart interrupted", key)
            self.runtime.finish_stop(session)
            final = "cancelled" if reason == "cancelled" else "ended"
            self.journal.set_state(key, final, now, f"{reason} (finished after a restart)")
            self._end_notice(session)
            self.journal.delete_meta(f"stopping:{key}")

    def _fail(self, action: Fail, now: datetime) -> None:
        # GPUs or ports may free up (a cancelled session ends, an ad-hoc one stops)
        self._back_off(action.key, now)
        self.journal.set_state(action.key, "failed", now, action.reason)
        log.error("%s: cannot be served: %s", action.key, action.reason)
        self._failure_notice(action.key, action.user, action.email, action.reason, now)

    def _warn(self, action: Warn, session: Session | None) -> None:
        key = action.key
        seconds = int(action.before.total_seconds())
        # the larger thresholds are past too: never send them after this one
        for warning in self.config.daemon.warnings:
            if warning >= action.before:
                self.remembered.warnings_sent.add((key, int(warning.total_seconds())))
        if session is None:
            return
        timezone = self.config.reservations.timezone
        remaining = action.end - self.clock()
        self.runtime.message(key, wall_text(remaining, action.end, timezone))
        address = self.notifier.address_for(session.user, session.email)
        if address:
            subject, body = warning_message(session, remaining, timezone)
            self._notice(key, f"warning-{seconds}-{action.end.isoformat()}", address, subject, body)

    def _notify_cancel(self, action: NotifyCancel, session: Session | None) -> None:
        self.remembered.cancel_notified.add(action.key)
        if session is None:
            return
        timezone = self.config.reservations.timezone
        self.runtime.message(
            action.key, wall_text(action.stop_at - self.clock(), action.stop_at, timezone)
        )
        address = self.notifier.address_for(session.user, session.email)
        if address:
            subject, body = cancel_message(session, action.stop_at, timezone)
            self._notice(action.key, "cancel", address, subject, body)

    def _mail_failure(
        self, key: str, user: str, email: str | None, subject: str, body: str
    ) -> None:
        """A failure notice to the user with the admin in copy (or to the admin alone)."""
        address = self.notifier.address_for(user, email) if user else None
        if address is not None:
            self._mail(key, address, subject, body, copy_admin=True)
        elif self.config.notify.admin:
            self._mail(key, self.config.notify.admin, subject, body)

    def _notice(self, key: str, kind: str, address: str, subject: str, body: str) -> bool:
        """Send a notice once per (key, kind); a failed send leaves it to be sent again.

        Returns False only when sending failed (True when sent now or before).
        """
        if not self.journal.mark_notified(key, kind, self.clock()):
            return True
        if not self._mail(key, address, subject, body):
            self.journal.unmark_notified(key, kind)
            return False
        return True

    def _mail(
        self, key: str, address: str, subject: str, body: str, *, copy_admin: bool = False
    ) -> bool:
        """Send one e-mail; a failure is logged and journaled, never raised."""
        try:
            self.notifier.send(address, subject, body, copy_admin=copy_admin, key=key)
        except NotifyError as error:
            log.error("%s: e-mail to %s failed: %s", key, address, error)
            self.journal.record_action(key, f"mail {subject!r}", self.clock(), "failed", str(error))
            return False
        return True
