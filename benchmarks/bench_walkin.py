"""A walk-in: from a booking that starts now appearing in a calendar to the first SSH login.

For each source (an ICS folder, CalDAV on Radicale, GRR on `make setup`'s
MariaDB), a daemon (`gpuresa run`, its own process) on `--engine` (Docker by
default, Podman, or udocker as a host account the benchmark makes and
removes) with the default config but for `--poll-interval`; `--runs`
bookings, each written at a random moment of the poll's cycle, each timed
until its user logs in. On udocker the login's first booking loads and
unpacks the image; each later one is written once the login's spare
container is there, as their next booking would find it.
Then what one unchanged poll costs each source (time, requests or queries,
bytes, CPU on the daemon's side and, for Radicale, on the server's). Prints
two tables; removes the sessions, calendars and database it made.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conftest import start_radicale
from daemon_stage import DaemonProcess, wait_ssh_ready
from grr_database import SOCKET, GRRDatabase
from support.accounts import kill_processes, remove_account
from support.configs import CalDav, write_daemon_config
from test_daemon_cli import ics_event

from gpuresa.backends.factory import open_backend
from gpuresa.backends.udocker.images import UdockerImages
from gpuresa.backends.udocker.spares import spares
from gpuresa.commands.host_commands import release_host
from gpuresa.config.calendar_sections import DaemonConfig
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.reservations.sources import CalendarSource, open_source

HOST = f"bench-walkin-{os.getpid()}"
# A booking is a walk-in: it starts the second it is written, for half an hour.
LENGTH = timedelta(minutes=30)
ENGINE_LINES = {
    "docker": "",
    "podman": 'engine = "podman"',
    "udocker": 'engine = "udocker"\ndriver_binaries = []',
}
# udocker runs each session as its login's own host account: one of the benchmark's own
ENGINE_LOGIN = {"udocker": f"bw{os.getpid()}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--poll-interval",
        default=None,
        help='the daemon\'s poll_interval, e.g. "30s" (default: the config default)',
    )
    parser.add_argument("--sources", default="ics,caldav,grr")
    parser.add_argument("--engine", choices=("docker", "podman", "udocker"), default="docker")
    parser.add_argument("--polls", type=int, default=50, help="unchanged polls timed per source")
    arguments = parser.parse_args()
    # a login tried before sshd answers is expected here, not worth a traceback
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    poll = arguments.poll_interval or f"{DaemonConfig().poll_interval.total_seconds():g}s"
    wanted = arguments.sources.split(",")
    rows: list[tuple[str, list[float | None]]] = []
    costs: list[tuple[str, dict[str, float]]] = []
    login = ENGINE_LOGIN.get(arguments.engine, "alice")
    if arguments.engine == "udocker":
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", login], check=True)
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        directory.chmod(0o755)  # a udocker login reaches its keys and session files here
        radicale = start_radicale(directory / "radicale")
        database: GRRDatabase | None = None
        try:
            database = GRRDatabase.create(directory)
            stages: dict[str, Callable[[Path], Booker]] = {
                "ics": lambda folder: FolderBooker(folder, arguments.engine, login),
                "caldav": lambda folder: CalDAVBooker(folder, arguments.engine, login, radicale),
                "grr": lambda folder: GRRBooker(folder, arguments.engine, login, database),
            }
            for name in wanted:
                booker = stages[name](directory / name)
                rows.append((name, walk_ins(booker, poll, arguments.runs)))
                costs.append((name, unchanged_poll_cost(booker, arguments.polls, radicale)))
        finally:
            radicale.stop()
            if database is not None:
                database.drop()
            if arguments.engine == "udocker":
                remove_account(login)
    engine = arguments.engine
    print(f"\nWalk-in: booking written -> first SSH login ({engine}, poll_interval = {poll})")
    print(f"{'source':<8} {'runs (s)':<28} {'median':>7} {'max':>7}")
    for name, times in rows:
        shown = " ".join("-" if value is None else f"{value:.1f}" for value in times)
        done = [value for value in times if value is not None]
        median = f"{statistics.median(done):.1f}" if done else "-"
        worst = f"{max(done):.1f}" if len(done) == len(times) else "never"
        print(f"{name:<8} {shown:<28} {median:>7} {worst:>7}")
    print(f"\nOne unchanged poll (median of {arguments.polls})")
    print(
        f"{'source':<8} {'ms':>7} {'requests':>9} {'bytes in':>9} {'CPU ms':>7} {'server ms':>10}"
    )
    for name, cost in costs:
        server = f"{cost['server_ms']:.2f}" if cost["server_ms"] >= 0 else "-"
        print(
            f"{name:<8} {cost['ms']:>7.2f} {cost['requests']:>9.0f} {cost['bytes']:>9.0f} "
            f"{cost['cpu_ms']:>7.2f} {server:>10}"
        )


class Booker:
    """A source's calendar: the config lines that name it, and how a booking is written."""

    def __init__(self, directory: Path, engine: str, login: str) -> None:
        self.directory, self.engine, self.login = directory, engine, login
        directory.mkdir(parents=True)
        directory.chmod(0o755)

    def calendar(self) -> CalDav | None:
        return None

    def replace_calendar(self, text: str) -> str:
        return text

    def book(self, key: str, start: datetime) -> str:
        """Write a booking for alice from `start`; returns the session key it becomes."""
        raise NotImplementedError


class FolderBooker(Booker):
    def book(self, key: str, start: datetime) -> str:
        (self.directory / "calendar" / f"{key}.ics").write_text(
            ics_event(key, start, start + LENGTH, self.login, "")
        )
        return key


class CalDAVBooker(Booker):
    def __init__(self, directory: Path, engine: str, login: str, radicale: Any) -> None:
        super().__init__(directory, engine, login)
        self.radicale = radicale
        self.collection = radicale.new_calendar()

    def calendar(self) -> CalDav | None:
        return CalDav(str(self.collection.url), self.radicale.username, self.radicale.password_file)

    def book(self, key: str, start: datetime) -> str:
        self.collection.save_event(ics_event(key, start, start + LENGTH, self.login, ""))
        return key


class GRRBooker(Booker):
    def __init__(self, directory: Path, engine: str, login: str, database: GRRDatabase) -> None:
        super().__init__(directory, engine, login)
        self.database = database
        self.room = database.add_room(f"GPU {os.getpid()}", database.add_area("GPU"))
        database.add_user(login, f"{login}@example.org")

    def replace_calendar(self, text: str) -> str:
        first, last = text.index("[[calendars]]"), text.index("[[hosts]]")
        return (
            text[:first]
            + f"""[[calendars]]
name = "grr"
kind = "grr"
url = "mysql://localhost/{self.database.name}"
unix_socket = "{SOCKET}"
username = "{self.database.reader}"
password_file = "{self.database.password_file}"
rooms = {{ "GPU {os.getpid()}" = "{HOST}" }}
default_template = "pytorch"

"""
            + text[last:]
        )

    def book(self, key: str, start: datetime) -> str:
        entry = self.database.book(self.room, start, start + LENGTH, self.login, "")
        return f"grr:grr_:{entry}"


def write_config(booker: Booker, poll: str, sessions: int) -> Config:
    defaults = DaemonConfig()
    file = write_daemon_config(
        booker.directory,
        host=HOST,
        calendar=booker.calendar(),
        sessions=sessions,
        gpus=(),
        users=(booker.login,),
        host_lines=ENGINE_LINES[booker.engine],
        # the defaults, which write_daemon_config would otherwise shorten for tests
        daemon=f'poll_interval = "{poll}"\n'
        f'prepare_ahead = "{defaults.prepare_ahead.total_seconds():g}s"\n'
        f'stop_grace = "{defaults.stop_grace.total_seconds():g}s"',
    )
    file.write_text(booker.replace_calendar(file.read_text()))
    for folder in ("keys", "calendar", "state"):
        (booker.directory / folder).mkdir(exist_ok=True)
        (booker.directory / folder).chmod(0o755)
    config = load_config(file)
    backend = open_backend(config)
    backend.provision("pytorch", None)
    backend.provision(None, None)  # the FTP sidecar's image, where the engine has one
    return config


def walk_ins(booker: Booker, poll: str, runs: int) -> list[float | None]:
    """Seconds from each booking written to its user's first login (None: not in 60 s)."""
    config = write_config(booker, poll, runs + 1)
    assert config.source is not None
    daemon = DaemonProcess(Path(config.source), booker.directory / "daemon.log")
    interval = config.daemon.poll_interval.total_seconds()
    times: list[float | None] = []
    try:
        time.sleep(5)  # the daemon's start and first poll
        for run in range(runs):
            # a random moment of the poll's cycle
            time.sleep(random.uniform(0, interval))
            if booker.engine == "udocker" and run:
                spare_ready(config, booker.login)  # made by the last walk-in's session
            written = time.monotonic()
            key = booker.book(f"walk-in-{run}", datetime.now(UTC).replace(microsecond=0))
            ready = wait_ssh_ready(config, key, written + 60, user=booker.login)
            # until the login is done: a udocker session's port is bound (by root) before its
            # container is up, so a login tried early waits there for it
            times.append(None if ready is None else time.monotonic() - written)
    finally:
        daemon.terminate()
        release_host(config, open_backend(config), everything=True)
        if booker.engine == "udocker":
            kill_processes(booker.login)  # the spare's maker: the folder goes next
    return times


def spare_ready(config: Config, login: str) -> None:
    """Wait (10 minutes at most) until the login's spare container of pytorch is made."""
    archive = UdockerImages(config).archive("pytorch", None)
    deadline = time.monotonic() + 600
    while archive and not spares(config, login, archive[1]) and time.monotonic() < deadline:
        time.sleep(0.2)


def unchanged_poll_cost(booker: Booker, polls: int, radicale: Any) -> dict[str, float]:
    """Median time, requests, bytes and CPU of one poll of the source, nothing having changed."""
    config = load_config(booker.directory / "config.toml")
    source: CalendarSource = open_source(
        config.calendars[0], None, persist=False, reservations=config.reservations
    )
    source.poll()
    server_pid = radicale.process.pid if isinstance(booker, CalDAVBooker) else None
    samples: dict[str, list[float]] = {key: [] for key in ("ms", "requests", "bytes", "cpu_ms")}
    server_before = cpu_seconds(server_pid) if server_pid else 0.0
    for _ in range(polls):
        began, cpu = time.perf_counter(), time.thread_time()
        result = source.poll()
        samples["cpu_ms"].append((time.thread_time() - cpu) * 1000)
        samples["ms"].append((time.perf_counter() - began) * 1000)
        samples["requests"].append(result.requests)
        samples["bytes"].append(result.bytes_received)
        assert not result.changed
    server = (cpu_seconds(server_pid) - server_before) * 1000 / polls if server_pid else -1.0
    cost = {key: statistics.median(values) for key, values in samples.items()}
    cost["server_ms"] = server
    return cost


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
