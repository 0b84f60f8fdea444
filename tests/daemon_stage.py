"""A stage for the daemon under attack: a relay that hangs, a hostile user, a daemon process.

Shared by tests/test_daemon_hostile.py and benchmarks/bench_daemon.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from conftest import TEST_HOST
from support.configs import write_daemon_config
from support.logins import try_login
from test_daemon_cli import ics_event

from gpuresa.backends.engines import Runtime
from gpuresa.backends.factory import open_backend
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config

# Programs a hostile user replaces in their session with ones that never return.
REPLACED = ("wall", "pkill", "pgrep", "kill", "timeout", "sleep")
NEVER_RETURNS = "#!/bin/sh\nexec tail -f /dev/null\n"


class HangingRelay:
    """An SMTP "relay" that accepts connections and never says a word."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(50)
        self.port = int(self.server.getsockname()[1])
        self.connections: list[socket.socket] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.connections.append(connection)

    def close(self) -> None:
        self.closed.set()
        self.server.close()
        for connection in self.connections:
            connection.close()


def write_config(directory: Path, sessions: int, relay_port: int, daemon_extra: str = "") -> Path:
    """A config for `sessions` sessions at once, mail through the relay at `relay_port`."""
    config = write_daemon_config(
        directory,
        host=TEST_HOST,
        sessions=sessions,
        passive_per_session=4,
        gpus=(),
        users=("alice", "bob"),
        daemon=f'prepare_ahead = "20s"\nstop_grace = "2s"\nwarnings = ["20s"]\n{daemon_extra}',
        limits="pids = 256",
        extra=f"""[notify]
enabled = true
smtp_host = "127.0.0.1"
smtp_port = {relay_port}
timeout = "60s"
[users.emails]
alice = "alice@example.org"
bob = "bob@example.org"
""",
    )
    runtime = Runtime(load_config(config))
    runtime.ensure_image("pytorch", None)
    runtime.ensure_ftp_image()
    return config


class DaemonProcess:
    """`gpuresa run` in its own process, its log in a file."""

    def __init__(self, config_file: Path, log_file: Path) -> None:
        self.log_file = log_file
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpuresa.cli", "--config", str(config_file), "-v", "run"],
            stdout=log_file.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def terminate(self) -> None:
        """SIGTERM, as systemd stops it; waits for the exit."""
        self.process.terminate()
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def wait_ssh_ready(
    config: Config, key: str, deadline: float, *, user: str = "alice", not_before: float = 0.0
) -> float | None:
    """The monotonic time at which session `key`'s user could first log in over SSH.

    A login, not a key exchange: a session prepared ahead answers SSH before its
    start but lets nobody in. Tries every 0.1 s from `not_before` on (each try
    costs a key exchange: polling early would load the machine being measured).
    """
    runtime = open_backend(config)  # any engine's sessions, udocker's too
    key_file = Path(config.source).parent / "key" if config.source else None
    port = None
    while time.monotonic() < deadline:
        if port is None:
            session = next((item for item in runtime.list_sessions() if item.key == key), None)
            port = session.ssh_port if session is not None else None
        if port is not None and time.monotonic() >= not_before:
            tried = time.monotonic()
            if _logs_in(port, user, key_file):
                return tried
        time.sleep(0.1)
    return None


def book_at_once(directory: Path, keys: list[str], start: datetime) -> None:
    """One booking per key in the stage's calendar folder, all for `start`, 30 minutes long."""
    for key in keys:
        (directory / "calendar" / f"{key}.ics").write_text(
            ics_event(key, start, start + timedelta(minutes=30), "alice", "")
        )


def start_latencies(config: Config, keys: list[str], start: datetime) -> dict[str, float | None]:
    """Seconds from `start` until each session's user could log in (None: not within 30 s)."""
    ready: dict[str, float | None] = {}

    def measure(key: str) -> None:
        ready[key] = wait_ssh_ready(config, key, at(start) + 30, not_before=at(start))

    threads = [threading.Thread(target=measure, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {key: None if moment is None else moment - at(start) for key, moment in ready.items()}


def _logs_in(port: int, user: str, key_file: Path | None) -> bool:
    client = try_login(port, user, key_file)
    if client is not None:
        client.close()
    return client is not None


def at(instant: datetime) -> float:
    """The monotonic time of a wall-clock instant (near now)."""
    return time.monotonic() + (instant - datetime.now(UTC)).total_seconds()


def make_hostile(main: Any) -> None:
    """In a session's main container, do what a hostile sudoer can.

    Replaces every program the daemon could run there with one that never
    returns, saves a result, and leaves processes that ignore SIGTERM, one
    of them started through sudo.
    """
    script = "; ".join(
        [
            f"for d in /usr/bin /bin /usr/sbin /sbin; do [ -e $d/{program} ] && "
            f"printf '%s' \"$HANG\" > $d/{program} && chmod 755 $d/{program}; done"
            for program in REPLACED
        ]
        + ["true"]
    )
    code, output = main.exec_run(["sh", "-c", script], environment={"HANG": NEVER_RETURNS})
    if code != 0:
        raise RuntimeError(f"could not replace the programs: {output!r}")
    main.exec_run(
        ["sh", "-c", "trap '' TERM; echo saved > /output/result.txt; exec tail -f /dev/null"],
        user="alice",
        detach=True,
    )
    main.exec_run(
        ["sudo", "sh", "-c", "trap '' TERM; exec tail -f /dev/null"], user="alice", detach=True
    )
