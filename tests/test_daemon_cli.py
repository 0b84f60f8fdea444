"""The admin commands around the daemon (plan, status, history), readiness and reload.

An ICS folder serves as the calendar here; the real Docker engine runs the
sessions and the daemon runs as its own process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import TEST_HOST, DockerHarness
from support.configs import write_daemon_config
from support.waiting import wait_for

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config


def ics_event(uid: str, start: datetime, end: datetime, summary: str, description: str) -> str:
    stamp = "20261101T000000Z"
    return (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//test//EN\r\nBEGIN:VEVENT\r\n"
        f"UID:{uid}\r\nDTSTAMP:{stamp}\r\n"
        f"DTSTART:{start:%Y%m%dT%H%M%SZ}\r\nDTEND:{end:%Y%m%dT%H%M%SZ}\r\n"
        f"SUMMARY:{summary}\r\nDESCRIPTION:{description}\r\n"
        "END:VEVENT\r\nEND:VCALENDAR\r\n"
    )


def gpuresa(config: Path, *arguments: str, **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(config), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def write_ics_config(directory: Path, daemon_extra: str = "") -> Path:
    """A config with an ICS folder calendar (directory/calendar) and a key for alice.

    `daemon_extra` adds lines to the [daemon] table. Returns the config file;
    the images its sessions need are built.
    """
    config = write_daemon_config(directory, host=TEST_HOST, daemon=daemon_extra)
    Runtime(load_config(config)).ensure_image("pytorch", None)
    Runtime(load_config(config)).ensure_ftp_image()  # starts never build images
    return config


@pytest.fixture
def setup(tmp_path: Path, docker_harness: DockerHarness) -> Iterator[Path]:
    """A config with an ICS folder calendar; yields the config file."""
    yield write_ics_config(tmp_path)


def test_plan_shows_what_would_happen_at_a_given_time(setup: Path) -> None:
    start = datetime(2030, 1, 7, 9, tzinfo=UTC)
    (setup.parent / "calendar" / "a.ics").write_text(
        ics_event("plan-1", start, start + timedelta(hours=2), "alice", "gpus: 1")
    )
    before = gpuresa(setup, "plan", "--at", "2030-01-07T08:00:00+00:00")
    assert before.returncode == 0, before.stderr
    assert "0 action(s)" in before.stdout
    at_start = gpuresa(setup, "plan", "--at", "2030-01-07T10:00:00+01:00")
    assert at_start.returncode == 0, at_start.stderr
    assert "start plan-1 for alice" in at_start.stdout
    bad = gpuresa(setup, "plan", "--at", "tomorrow")
    assert bad.returncode == 1 and "--at: expected an ISO 8601 time" in bad.stderr


def test_status_and_history_before_any_run_say_so(setup: Path) -> None:
    result = gpuresa(setup, "status")
    assert result.returncode == 1
    assert "no journal yet" in result.stderr and "Traceback" not in result.stderr


def test_status_before_any_run_says_what_the_daemon_will_do_and_how_to_start_it(
    tmp_path: Path,
) -> None:
    config = write_daemon_config(tmp_path, host=TEST_HOST)
    for command in ("status", "history"):
        result = gpuresa(config, command)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        said = result.stderr
        assert "no journal yet: the daemon has not run with this config" in said
        assert "polls the calendars (folder) every 1s" in said
        assert f"booked on host {TEST_HOST!r}" in said
        assert "systemctl enable --now gpuresa" in said and f"--config {config} run" in said
    assert not (tmp_path / "state" / "journal.sqlite").exists()  # status made none


def journal_with_a_failed_start(config: Path, reason: str) -> str:
    """A journal (as the daemon leaves it) where a booking's start failed for `reason`."""
    from gpuresa.daemon import journal_path
    from gpuresa.journal.store import Journal
    from gpuresa.model import Reservation

    loaded = load_config(config)
    now = datetime.now(UTC)
    booking = Reservation(
        key="failed-1", uid="failed-1", recurrence_id=None, calendar="folder",
        host=loaded.daemon.host, user="alice", template="pytorch", cuda=None, gpus=1,
        start=now - timedelta(minutes=1), end=now + timedelta(hours=1),
    )  # fmt: skip
    journal_path(loaded).parent.mkdir(parents=True, exist_ok=True)
    journal = Journal(journal_path(loaded))
    try:
        journal.reservations.record([booking], [], now)
        journal.states.set(booking.key, "preparing", now)
        journal.states.set(booking.key, "failed", now, reason)
    finally:
        journal.close()
    return booking.key


def test_status_shows_why_a_booking_failed(tmp_path: Path) -> None:
    config = write_daemon_config(tmp_path, host=TEST_HOST)
    # a start error with a line of container output, which its user wrote
    reason = "attempt 3: Docker could not build pytorch:\nstep 2: \x1b[2J<2>forged: stopped"
    key = journal_with_a_failed_start(config, reason)
    shown = gpuresa(config, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    [item] = json.loads(shown.stdout)["upcoming"]
    assert (item["key"], item["state"], item["reason"]) == (key, "failed", reason)
    text = gpuresa(config, "status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    [row] = [index for index, line in enumerate(lines) if line.startswith(f"  {key} ")]
    assert lines[row].endswith("[failed]")
    assert lines[row + 1] == "      reason: attempt 3: Docker could not build pytorch:"
    # the user's text stays inert and indented under its row: it cannot pass for a row
    assert lines[row + 2] == "      | step 2: \\x1b[2J<2>forged: stopped"
    assert "\x1b" not in text.stdout


def test_daemon_reports_ready_status_history_and_reloads(
    setup: Path, tmp_path: Path, docker_harness: DockerHarness
) -> None:
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=3)
    calendar = setup.parent / "calendar"
    (calendar / "a.ics").write_text(
        ics_event("status-1", start, start + timedelta(minutes=5), "alice", "gpus: 1")
    )
    (calendar / "b.ics").write_text(
        ics_event("status-2", start, start + timedelta(minutes=5), "Bad/Login", "gpus: 1")
    )
    notify_path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_path))
    receiver.settimeout(30)
    log = tmp_path / "daemon.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(setup), "-v", "run"],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
    )
    try:
        assert receiver.recv(4096).decode().startswith("READY=1")

        def running() -> dict[str, object] | None:
            result = gpuresa(setup, "status", "--json")
            assert result.returncode == 0, result.stderr
            report: dict[str, object] = json.loads(result.stdout)
            sessions = report["sessions"]
            assert isinstance(sessions, list)
            return report if any(item["state"] == "running" for item in sessions) else None

        report = wait_for(running, 30, "a running session in gpuresa status", every=0.5)
        sessions = report["sessions"]
        assert isinstance(sessions, list) and len(sessions) == 1
        assert sessions[0]["key"] == "status-1" and sessions[0]["user"] == "alice"
        assert sessions[0]["until"] == (start + timedelta(minutes=5)).isoformat()
        rejected = report["rejected"]
        assert isinstance(rejected, list)
        assert [item["key"] for item in rejected] == ["status-2"]
        calendars = report["calendars"]
        assert isinstance(calendars, dict)
        assert calendars["folder"]["last_error"] is None
        assert calendars["folder"]["stale_seconds"] <= 5

        text = gpuresa(setup, "status")
        assert "status-1" in text.stdout and "rejected (1)" in text.stdout

        history = gpuresa(setup, "history", "--user", "alice")
        assert history.returncode == 0
        assert "status-1" in history.stdout and "running" in history.stdout
        assert "status-2" not in history.stdout

        # a broken config on reload is refused and the daemon goes on
        good = setup.read_text()
        setup.write_text(good + "\n[daemon.typo]\n")
        process.send_signal(signal.SIGHUP)
        wait_for_log(log, "reload refused")
        setup.write_text(good.replace('poll_interval = "1s"', 'poll_interval = "2s"'))
        process.send_signal(signal.SIGHUP)
        wait_for_log(log, "configuration reloaded")
        assert process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        receiver.close()
    # SIGTERM ends the daemon, not the session
    assert [session.key for session in Runtime(load_config(setup)).list_sessions()] == ["status-1"]


def wait_for_log(log: Path, text: str, timeout: float = 20) -> None:
    try:
        wait_for(lambda: text in log.read_text(errors="replace"), timeout, repr(text), every=0.2)
    except pytest.fail.Exception:
        pytest.fail(f"{text!r} not in the daemon log:\n{log.read_text()[-3000:]}")


def test_status_says_how_long_each_gpu_stays_free(tmp_path: Path) -> None:
    from zoneinfo import ZoneInfo

    from gpuresa.daemon import journal_path
    from gpuresa.journal.store import Journal
    from gpuresa.model import Rejection, Reservation
    from gpuresa.reservations.conflicts import site_time

    config = write_daemon_config(
        tmp_path, host=TEST_HOST, gpus=(0, 1), extra='[reservations]\ntimezone = "Europe/Paris"'
    )
    # GPUs this host hands out by index (the test starts no session on them)
    config.write_text(config.read_text().replace('gpu_mode = "none"', 'gpu_mode = "nvidia"'))
    loaded = load_config(config)
    now = datetime.now(UTC).replace(second=0, microsecond=0)

    def booked(key: str, user: str, start: timedelta, hours: int, gpus: int) -> Reservation:
        return Reservation(
            key=key, uid=key, recurrence_id=None, calendar="folder", host=loaded.daemon.host,
            user=user, template="pytorch", cuda=None, gpus=gpus, start=now + start,
            end=now + start + timedelta(hours=hours),
        )  # fmt: skip

    held = booked("held-1", "alice", -timedelta(hours=1), 2, 1)
    # a login with a terminal escape: the plain report shows it inert
    later = booked("next-1", "eve\x1b[2J", timedelta(hours=3), 1, 2)
    # either, counted, would take GPU 1 before `later` does
    cancelled = booked("gone-1", "bob", timedelta(minutes=30), 1, 1)
    refused = booked("refused-1", "bob", timedelta(minutes=10), 1, 1)
    journal_path(loaded).parent.mkdir(parents=True, exist_ok=True)
    journal = Journal(journal_path(loaded))
    try:
        journal.reservations.record([held, later, cancelled, refused], [], now)
        journal.states.set(cancelled.key, "cancelled", now)
        # accepted once, rejected since: its GPUs are nobody's
        journal.reservations.record(
            [], [Rejection(refused.key, refused.uid, "folder", "too many GPUs", "bob")], now
        )
    finally:
        journal.close()

    shown = gpuresa(config, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    free = json.loads(shown.stdout)["free"]
    assert free["mode"] == "gpus"
    first, second = free["gpus"]
    assert first["holder"]["key"] == "held-1" and first["free_from"] == held.end.isoformat()
    assert first["ended_by"]["key"] == "next-1"
    assert second["holder"] is None and second["ended_by"]["key"] == "next-1"
    assert first["free_until"] == second["free_until"] == later.start.isoformat()
    paris = ZoneInfo("Europe/Paris")
    assert first["text"] == (
        f"busy (alice, until {site_time(held.end, paris)}), then free until "
        f"{site_time(later.start, paris)} (eve\x1b[2J's booking)"
    )
    assert (
        second["text"] == f"free now, until {site_time(later.start, paris)} (eve\x1b[2J's booking)"
    )

    text = gpuresa(config, "status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    heading = lines.index("free from now (what a walk-in booking can get):")
    assert lines[heading + 1].startswith(
        f"  GPU 0: busy (alice, until {site_time(held.end, paris)})"
    )
    assert lines[heading + 2].startswith("  GPU 1: free now, until ")
    assert "eve\\x1b[2J's booking" in lines[heading + 2] and "\x1b" not in text.stdout
