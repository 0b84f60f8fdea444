"""The service: one daemon per state directory, its threads, signals and the watchdog.

`Daemon.start()` takes the state directory's lock, opens the journal and
starts the loop and the outbox; `run()` adds the signals and systemd's
notifications and blocks until SIGTERM or SIGINT. Sessions are Docker's and
outlive the daemon: stopping it ends only its threads, within a few seconds
whatever is in flight, and the next start adopts what runs and finishes what
was cut short.
"""

from __future__ import annotations

import faulthandler
import fcntl
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import IO
from zoneinfo import ZoneInfo

from gpuresa import systemd
from gpuresa.backends.engines.host_holds import release_unneeded
from gpuresa.backends.port_safety import port_warnings
from gpuresa.config.pid_budget import pids_warnings
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.daemon.loop import Loop
from gpuresa.daemon.sampling import Sampler
from gpuresa.daemon.state import Context, utc_now
from gpuresa.errors import UserError
from gpuresa.gpus.telemetry import Telemetry
from gpuresa.gpus.tracker import HostInspector
from gpuresa.gpus.usage_store import USAGE_FILE, UsageStore
from gpuresa.journal.guard import open_journal
from gpuresa.journal.store import Journal
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Session
from gpuresa.observe.server import ObservationServer
from gpuresa.outputs.disk import disk_warnings
from gpuresa.sessions.errors import RuntimeUnavailable
from gpuresa.sessions.protocol import SessionBackend
from gpuresa.writeback.worker import WriteBackWorker

log = logging.getLogger(__name__)

# With the loop silent for this long, the daemon counts as stuck (the loop
# never waits on anything outside, so this means a bug): the watchdog restarts it.
STUCK_AFTER = timedelta(minutes=2)
# How long a shutdown waits for actions under way to finish (SIGTERM must end
# the daemon within 5 s, whatever is in flight).
SHUTDOWN_WAIT = 3.0


def journal_path(config: Config) -> Path:
    return config.daemon.state_dir / "journal.sqlite"


class Daemon:
    """gpuresa's service. `run()` blocks until SIGTERM/SIGINT; sessions outlive it.

    `runtime`, `telemetry` and `inspector` replace the gateways to Docker, the
    GPUs and the host's /proc and cgroups (tests);
    `on_start` is called on the loop with each session that started.
    """

    def __init__(
        self,
        config: Config,
        *,
        runtime: SessionBackend | None = None,
        clock: Callable[[], datetime] = utc_now,
        on_start: Callable[[Session, str], None] | None = None,
        telemetry: Telemetry | None = None,
        inspector: HostInspector | None = None,
    ) -> None:
        self.config = config
        self._runtime = runtime
        self._telemetry = telemetry
        self._inspector = inspector
        self.sampler: Sampler | None = None
        self.server: ObservationServer | None = None
        self._clock = clock
        self._on_start = on_start
        self.lock_file: IO[str] | None = None
        self.stopping = threading.Event()
        self.loop: Loop | None = None
        self.outbox: Outbox | None = None
        self.writeback: WriteBackWorker | None = None
        self._thread: threading.Thread | None = None
        self._journal: Journal | None = None

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise RuntimeError("the daemon has not started")
        return self._journal

    @property
    def docker_backoff(self) -> timedelta:
        return self.loop.survey.backoff if self.loop is not None else timedelta(seconds=1)

    # --- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Take the state directory's lock, open the journal, start the loop and the outbox.

        Raises `UserError` when another daemon already uses the state directory:
        two daemons would start the same sessions and remove each other's.
        """
        state_dir = self.config.daemon.state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        lock_path = state_dir / "daemon.lock"
        self.lock_file = lock_path.open("a+")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.close()
            self.lock_file = None
            other = "?"
            try:
                with Journal(journal_path(self.config), read_only=True) as journal:
                    other = journal.facts.get("daemon_pid") or "?"
            except UserError:
                pass
            raise UserError(
                f"another gpuresa daemon (pid {other}) uses {state_dir}; "
                "stop it first (systemctl stop gpuresa)"
            ) from None
        journal, problem = open_journal(journal_path(self.config))
        self._journal = journal
        journal.facts.set("daemon_pid", str(os.getpid()))
        self.outbox = Outbox(journal, _notifier(self.config), clock=self._clock)
        # calendar write-back runs beside the loop like the outbox (`gpuresa.writeback`)
        self.writeback = WriteBackWorker(self.config, journal, clock=self._clock)
        context = Context(
            self.config,
            journal,
            self.outbox,
            runtime=self._runtime,
            clock=self._clock,
            writeback=self.writeback,
        )
        if problem:
            context.notices.to_admin(
                f"journal:{self.config.daemon.host}",
                f"journal-{self._clock().isoformat()}",
                "the journal could not be opened and was set aside",
                f"{problem}\n\nThe daemon goes on with a new journal and rebuilds what runs "
                "from Docker's labels. Past history is in the file set aside.\n",
            )
        warnings = [
            *port_warnings(self.config),
            *disk_warnings(self.config),
            *pids_warnings(self.config),
        ]
        for warning in warnings:
            log.warning("%s", warning)
        self.sampler = Sampler(UsageStore(state_dir / USAGE_FILE), self._telemetry, self._inspector)
        self.loop = Loop(context, on_start=self._on_start, sampler=self.sampler)
        if self.config.telemetry.listen:
            try:
                self.server = self._serve(self.config)
            except OSError as error:
                self._release()
                raise UserError(
                    f"cannot serve the metrics and status page on {self.config.telemetry.listen}"
                    f" ([telemetry] listen): {error}"
                ) from None
        self.outbox.start()
        self.writeback.start()
        self._thread = threading.Thread(target=self.loop.run, name="gpuresa-loop", daemon=True)
        self._thread.start()
        log.info(
            "gpuresa started for host %s: %d calendar(s), polled every %ss",
            self.config.daemon.host,
            len(self.config.calendars),
            int(self.config.daemon.poll_interval.total_seconds()),
        )

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
        beat = min(interval / 2, 5.0) if interval else 5.0
        try:
            while not self.stopping.wait(beat):
                self._feed_watchdog()
        finally:
            systemd.stopping()
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the loop and the outbox (a few seconds at most); sessions go on in Docker.

        Actions still under way are abandoned (their threads are daemon
        threads); what they did not finish is finished after the next start.
        """
        log.info("gpuresa stopping; running sessions go on and will be adopted at the next start")
        self.stopping.set()
        deadline = time.monotonic() + SHUTDOWN_WAIT
        if self.server is not None:
            self.server.stop()  # half a second at most: it polls for shutdown twice a second
            self.server = None
        if self.loop is not None:
            self.loop.stopping.set()
            self.loop.wake()
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.1))
        if self.outbox is not None:
            self.outbox.stop(timeout=max(deadline - time.monotonic(), 0.1))
        if self.writeback is not None:
            self.writeback.stop(timeout=max(deadline - time.monotonic(), 0.1))
        if self.loop is not None:
            # a stop whose containers are gone has only its journal lines left to write; a
            # background job (the outputs duty) may be making a container: let it finish
            # rather than leave it half made
            loop = self.loop
            while (
                loop.executor.running() or loop.tools.background_running()
            ) and time.monotonic() < deadline:
                time.sleep(0.05)
            busy = sorted(f"{entry.what} {entry.key}" for entry in loop.executor.running())
            busy += loop.tools.background_running()
            if busy:
                log.warning("left under way, to be finished after the next start: %s", busy)
            # an action under way may be mounting: then everything is kept (and listed)
            self._release_host(loop, listed=not busy)
        self._release()

    def _release_host(self, loop: Loop, *, listed: bool) -> None:
        """Let go of the mounts and loop devices no running session needs (see `host_holds`);
        with `listed` False, or sessions that cannot be listed, keep them all."""
        running: list[str] | None = None
        try:
            if listed:
                running = [session.key for session in loop.context.runtime.list_sessions()]
        except (RuntimeUnavailable, UserError) as error:
            log.warning("the sessions cannot be listed; the host keeps what it holds: %s", error)
        release_unneeded(self.config, running)

    def _release(self) -> None:
        """Close the usage store, the journal and the state directory's lock."""
        if self.sampler is not None and not (self.loop is not None and self.loop.sampling):
            # a sample under way (NVML that hangs) keeps its store; the process ends anyway
            self.sampler.close()
        self.sampler = None
        if self._journal is not None and not (self.loop and self.loop.executor.running()):
            # closing waits for the journal's lock, which a stuck action may hold; a
            # journal left open is safe (SQLite's WAL), and the process ends anyway
            self._journal.close()
        if self.lock_file is not None:
            self.lock_file.close()  # releases the state directory's lock
            self.lock_file = None

    def _serve(self, config: Config) -> ObservationServer:
        """Start the observation server at `[telemetry] listen`; raises `OSError` if taken."""
        assert self.loop is not None and config.telemetry.listen is not None
        server = ObservationServer(
            config.telemetry.listen,
            self.loop.published.current,
            ZoneInfo(config.reservations.timezone),
            config.telemetry.page_days,
        )
        server.start()
        return server

    def _on_stop_signal(self, number: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(number).name)
        self.stopping.set()

    def _on_reload_signal(self, number: int, frame: FrameType | None) -> None:
        if self.loop is not None:
            self.loop.post(self.reload)

    def reload(self) -> None:
        """Read the config file again (on the loop); a bad file is logged and the old one kept."""
        path = self.config.source
        try:
            config = load_config(path)
        except UserError as error:
            log.error("reload refused, keeping the running config: %s", error)
            return
        self.config = config
        if self.loop is not None and self.outbox is not None:
            old = self.loop.context
            self.outbox.set_notifier(_notifier(config))
            if self.writeback is not None:
                self.writeback.set_config(config)
            self.loop.context = Context(
                config, old.journal, self.outbox, clock=self._clock, writeback=self.writeback
            )
            self.loop.request_round()
            self._follow_listen(config)
        log.info("configuration reloaded from %s", path)

    def _follow_listen(self, config: Config) -> None:
        """Follow `[telemetry] listen` after a reload: a new address gets a new server.

        The old server keeps serving when the new address cannot be had.
        """
        listen = config.telemetry.listen
        if self.server is not None and listen == self.server.listen:
            self.server.zone = ZoneInfo(config.reservations.timezone)
            self.server.days = config.telemetry.page_days
            return
        server = None
        if listen:
            try:
                server = self._serve(config)
            except OSError as error:
                log.error("cannot serve on %s (%s); the old address stays", listen, error)
                return
        if self.server is not None:
            self.server.stop()
        self.server = server

    def _feed_watchdog(self) -> None:
        """Tell systemd we are alive, unless the loop has not turned for too long."""
        if self.loop is None:
            return
        silent = self.loop.clock.monotonic() - self.loop.heartbeat
        if silent < STUCK_AFTER.total_seconds():
            systemd.watchdog()
        else:
            log.error("the loop has not turned for %d s; letting the watchdog restart us", silent)


def _notifier(config: Config) -> Notifier:
    return Notifier(config.notify, config.users)
