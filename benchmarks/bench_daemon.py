"""Daemon benchmark: start and end latency of real sessions, and the idle daemon's cost.

Runs a real Radicale server, the real Docker engine and the daemon as its own
process, books reservations with the caldav client and prints a table:

* start latency: first successful SSH login minus the booking's start time;
* end latency: containers gone minus (end + stop grace);
* start latency of eight sessions booked for the same instant (SSH key exchange);
* start latency of a session that starts during a hostile session's last
  warning, with the SMTP relay hanging (the hostile user replaced `wall`,
  `pkill` and the rest in their session and left processes that ignore SIGTERM);
* idle cost: CPU seconds and resident memory of the daemon over 60 s with 50
  upcoming reservations in the calendar, at two poll intervals.

With `--write-back`, only the start latency, with 1,000 (`--bookings`) more
bookings in the calendar, all refused, with calendar write-back off and then
"event" (each refusal written into its event while the sessions start).

Usage: .venv/bin/python benchmarks/bench_daemon.py [--sessions 5] [--write-back]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import paramiko

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conftest import start_radicale
from daemon_stage import (
    DaemonProcess,
    HangingRelay,
    at,
    book_at_once,
    make_hostile,
    start_latencies,
    wait_ssh_ready,
)
from daemon_stage import write_config as write_stage_config
from support.configs import CalDav, free_ports, write_daemon_config
from test_daemon_cli import ics_event

from gpuresa.backends.engines import Runtime
from gpuresa.commands.host_commands import release_host
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.journal.store import Journal

HOST = f"bench-{os.getpid()}"


def port_block(size: int) -> int:
    """The first of `size` consecutive free ports on 127.0.0.1."""
    return free_ports(size)


def write_config(
    directory: Path, calendar_url: str, radicale: Any, poll: str, write_back: str = "off"
) -> Config:
    """The daemon's config: the CalDAV calendar at `calendar_url`, ten sessions at once,
    its `write_back` as given."""
    file = write_daemon_config(
        directory,
        host=HOST,
        calendar=CalDav(calendar_url, radicale.username, radicale.password_file),
        sessions=10,
        passive_per_session=4,
        gpus=range(8),
        daemon=f'poll_interval = "{poll}"\nprepare_ahead = "8s"\nstop_grace = "2s"\n'
        'warnings = ["5s"]',
    )
    text = file.read_text()
    file.write_text(
        text.replace("[[calendars]]\n", f'[[calendars]]\nwrite_back = "{write_back}"\n', 1)
    )
    return load_config(file)


def first_login(port: int, key_file: Path, deadline: float) -> float | None:
    """time.time() of the first successful SSH login on `port`, or None by `deadline`."""
    while time.time() < deadline:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(
                "127.0.0.1",
                port=port,
                username="alice",
                key_filename=str(key_file),
                timeout=1,
                banner_timeout=1,
                auth_timeout=1,
                allow_agent=False,
                look_for_keys=False,
            )
            return time.time()
        except (paramiko.SSHException, OSError, EOFError):
            time.sleep(0.05)
        finally:
            client.close()
    return None


def latency(
    directory: Path, count: int, write_back: str = "off", background: int = 0
) -> tuple[list[float], list[float]]:
    """Start and end latencies of `count` sessions, with `background` more bookings in the
    calendar, each refused (an unknown template): with write-back on, each refusal is
    written into its event while the sessions start."""
    radicale = start_radicale(directory / "radicale")
    try:
        calendar = radicale.new_calendar("bench")
        config = write_config(directory, str(calendar.url), radicale, "5s", write_back)
        later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
        for index in range(background):
            start = later + timedelta(minutes=index)
            calendar.save_event(
                dtstart=start,
                dtend=start + timedelta(minutes=1),
                summary="alice",
                uid=f"background-{index}",
                description="template: no-such-template\ngpus: 1",
            )
        runtime = Runtime(config)
        runtime.ensure_image("pytorch", None)
        runtime.ensure_ftp_image()  # starts never build images
        key_file = directory / "key"
        base = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=20)
        bookings = []
        for index in range(count):
            start = base + timedelta(seconds=12 * index)
            end = start + timedelta(seconds=15)
            calendar.save_event(
                dtstart=start,
                dtend=end,
                summary="alice",
                uid=f"bench-{index}",
                description="template: pytorch\ngpus: 1",
            )
            bookings.append((f"bench-{index}", start, end))
        daemon = DaemonProcess(Path(config.source), directory / "daemon.log")
        started = time.time()
        starts: list[float] = []
        ends: list[float] = []
        lock = threading.Lock()

        def measure(key: str, start: datetime, end: datetime) -> None:
            port = None
            while time.time() < start.timestamp() + 30:
                session = next((s for s in runtime.list_sessions() if s.key == key), None)
                if session is not None:
                    port = session.ssh_port
                    break
                time.sleep(0.2)
            if port is None:
                return
            login = first_login(port, key_file, start.timestamp() + 30)
            grace = config.daemon.stop_grace.total_seconds()
            gone = None
            while time.time() < end.timestamp() + grace + 30:
                if not any(s.key == key for s in runtime.list_sessions()):
                    gone = time.time()
                    break
                time.sleep(0.1)
            with lock:
                if login is not None:
                    starts.append(login - start.timestamp())
                if gone is not None:
                    ends.append(gone - (end.timestamp() + grace))

        threads = [threading.Thread(target=measure, args=booking) for booking in bookings]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        finally:
            daemon.terminate()
            _remove_sessions(config)
        if write_back != "off":
            _print_written(config, started)
        return starts, ends
    finally:
        radicale.stop()


def simultaneous(directory: Path, count: int) -> list[float]:
    """Seconds from the shared start to each session's first SSH key exchange."""
    relay = HangingRelay()
    try:
        config_file = write_stage_config(directory, count, relay.port)
        config = load_config(config_file)
        start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=25)
        keys = [f"nine-{index}" for index in range(count)]
        book_at_once(directory, keys, start)
        daemon = DaemonProcess(config_file, directory / "daemon.log")
        try:
            latencies = start_latencies(config, keys, start)
        finally:
            daemon.stop()
            _remove_sessions(config)
        return [latency for latency in latencies.values() if latency is not None]
    finally:
        relay.close()


def hostile_neighbour(directory: Path) -> float | None:
    """Start latency of a session beginning in a hostile session's last warning."""
    relay = HangingRelay()
    try:
        config_file = write_stage_config(directory, 2, relay.port)
        config = load_config(config_file)
        now = datetime.now(UTC).replace(microsecond=0)
        hostile_end = now + timedelta(seconds=45)
        second_start = hostile_end - timedelta(seconds=10)
        calendar = directory / "calendar"
        calendar.joinpath("hostile.ics").write_text(
            ics_event("hostile", now, hostile_end, "alice", "")
        )
        calendar.joinpath("second.ics").write_text(
            ics_event("second", second_start, second_start + timedelta(minutes=30), "bob", "")
        )
        daemon = DaemonProcess(config_file, directory / "daemon.log")
        try:
            if wait_ssh_ready(config, "hostile", time.monotonic() + 30) is None:
                return None
            runtime = Runtime(config)
            main = runtime.engine.client.containers.list(
                filters={"label": ["gpuresa.reservation=hostile", "gpuresa.role=main"]}
            )[0]
            make_hostile(main)
            ready = wait_ssh_ready(
                config, "second", at(second_start) + 30, user="bob", not_before=at(second_start)
            )
            return None if ready is None else ready - at(second_start)
        finally:
            daemon.stop()
            _remove_sessions(config)
    finally:
        relay.close()


def _remove_sessions(config: Config) -> None:
    """Remove what the daemon left: its sessions, its output service (which holds a port),
    and the mounts and loop devices of its output root (`gpuresa host release --all`)."""
    stopped, kept, _ = release_host(config, Runtime(config), everything=True)
    if stopped:
        print(f"stopped sessions the daemon left running: {', '.join(stopped)}")
    if kept:
        print(f"still held on the host: {', '.join(map(str, kept))}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def idle(directory: Path, poll: str, seconds: int) -> tuple[float, float]:
    radicale = start_radicale(directory / "radicale")
    try:
        calendar = radicale.new_calendar("idle")
        tomorrow = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)
        for index in range(50):
            start = tomorrow + timedelta(hours=index)
            calendar.save_event(
                dtstart=start,
                dtend=start + timedelta(minutes=50),
                summary="alice",
                uid=f"idle-{index}",
                description="template: pytorch\ngpus: 1",
            )
        config = write_config(directory, str(calendar.url), radicale, poll)
        daemon = DaemonProcess(Path(config.source), directory / "daemon.log")
        try:
            time.sleep(10)  # start-up and the first poll are not idle time
            before = cpu_seconds(daemon.process.pid)
            time.sleep(seconds)
            used = cpu_seconds(daemon.process.pid) - before
            memory = rss_mib(daemon.process.pid)
        finally:
            daemon.terminate()
            _remove_sessions(config)
        return used, memory
    finally:
        radicale.stop()


def main() -> None:
    # the login probes fail until sshd answers; paramiko logs each failure as an error
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--idle-seconds", type=int, default=60)
    parser.add_argument("--hostile-rounds", type=int, default=3)
    parser.add_argument(
        "--write-back",
        action="store_true",
        help="only the start latency, with --bookings refused bookings in the calendar, "
        'with calendar write-back "off" and then "event"',
    )
    parser.add_argument("--bookings", type=int, default=1000)
    arguments = parser.parse_args()
    if arguments.write_back:
        write_back_rows(arguments.sessions, arguments.bookings)
        return
    with tempfile.TemporaryDirectory(prefix="gpuresa-bench-") as temporary:
        root = Path(temporary)
        starts, ends = latency(root / "latency", arguments.sessions)
        (root / "eight").mkdir()
        eight = simultaneous(root / "eight", 8)
        neighbours = []
        for index in range(arguments.hostile_rounds):
            (root / f"hostile-{index}").mkdir()
            measured = hostile_neighbour(root / f"hostile-{index}")
            if measured is not None:
                neighbours.append(measured)
        idle_rows = []
        for poll in ("30s", "5s"):
            used, memory = idle(root / f"idle-{poll}", poll, arguments.idle_seconds)
            idle_rows.append((poll, used, memory))
    print(f"\n{'measure':<52} {'n':>3} {'median':>9} {'max':>9}")
    for name, values in (
        ("start latency: SSH login - start (s)", starts),
        ("end latency: containers gone - (end+grace) (s)", ends),
        ("eight at once: SSH ready - start (s)", eight),
        ("beside a hostile session, relay hanging (s)", neighbours),
    ):
        if values:
            print(
                f"{name:<52} {len(values):>3} {statistics.median(values):>9.2f} {max(values):>9.2f}"
            )
        else:
            print(f"{name:<52} {0:>3} {'-':>9} {'-':>9}")
    cpu_heading = f"CPU s / {arguments.idle_seconds} s"
    print(f"\n{'idle daemon, 50 upcoming reservations':<40} {cpu_heading:>14} {'RSS MiB':>9}")
    for poll, used, memory in idle_rows:
        print(f"{'poll every ' + poll:<40} {used:>14.2f} {memory:>9.1f}")


def _print_written(config: Config, started: float) -> None:
    """How many states the daemon wrote back, and when the last one was written."""
    journal = Journal(config.daemon.state_dir / "journal.sqlite", read_only=True)
    with contextlib.closing(journal):
        rows = journal.writeback.of_calendars([calendar.name for calendar in config.calendars])
    written = [row.written_at for row in rows if row.written_at is not None]
    last = max(written).timestamp() - started if written else float("nan")
    print(f"write-back: {len(written)} of {len(rows)} states written, the last {last:.0f} s "
          "after the daemon's start")  # fmt: skip


def write_back_rows(sessions: int, bookings: int) -> None:
    """The start latency with `bookings` refused bookings, write-back off, then on."""
    rows = []
    for mode in ("off", "event"):
        with tempfile.TemporaryDirectory(prefix="gpuresa-bench-") as temporary:
            starts, _ = latency(Path(temporary) / "latency", sessions, mode, bookings)
            rows.append((mode, starts))
    print(f"\n{'start latency, ' + str(bookings) + ' bookings refused':<52} {'n':>3} "
          f"{'median':>9} {'max':>9}")  # fmt: skip
    for mode, starts in rows:
        name = f"write_back = {mode!r}"
        if starts:
            print(f"{name:<52} {len(starts):>3} {statistics.median(starts):>9.2f} "
                  f"{max(starts):>9.2f}")  # fmt: skip
        else:
            print(f"{name:<52} {0:>3} {'-':>9} {'-':>9}")


if __name__ == "__main__":
    main()
