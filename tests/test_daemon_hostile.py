"""Every booking on time, whatever one user or one outside system does.

Real Docker, real sshd in the sessions, a real SMTP relay that hangs. The
daemon runs as its own process (`gpuresa run`), as under systemd.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import DockerHarness
from daemon_stage import (
    DaemonProcess,
    HangingRelay,
    at,
    book_at_once,
    make_hostile,
    start_latencies,
    wait_ssh_ready,
    write_config,
)
from support.waiting import wait_for
from test_daemon_cli import ics_event

from gpuresa.config.reading import load_config


@pytest.fixture
def relay() -> Iterator[HangingRelay]:
    server = HangingRelay()
    yield server
    server.close()


@pytest.fixture
def daemon_log(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    log_file = tmp_path / "daemon.log"
    yield log_file
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed and log_file.exists():
        print("--- daemon log:\n" + log_file.read_text()[-20000:])


def test_a_hostile_user_and_a_hanging_relay_delay_no_other_booking(
    tmp_path: Path, docker_harness: DockerHarness, relay: HangingRelay, daemon_log: Path
) -> None:
    config_file = write_config(tmp_path, 2, relay.port)
    config = load_config(config_file)
    now = datetime.now(UTC).replace(microsecond=0)
    hostile_end = now + timedelta(seconds=45)
    # the second booking starts during the hostile session's last warning (end - 20 s)
    second_start = hostile_end - timedelta(seconds=10)
    calendar = tmp_path / "calendar"
    (calendar / "hostile.ics").write_text(ics_event("hostile", now, hostile_end, "alice", ""))
    (calendar / "second.ics").write_text(
        ics_event("second", second_start, second_start + timedelta(minutes=30), "bob", "")
    )
    daemon = DaemonProcess(config_file, daemon_log)
    try:
        assert wait_ssh_ready(config, "hostile", time.monotonic() + 30) is not None
        main = next(c for c in docker_harness.ours() if c.labels["gpuresa.role"] == "main")
        # the user is root in their session: every program the daemon could run hangs
        make_hostile(main)
        ready = wait_ssh_ready(
            config, "second", at(second_start) + 15, user="bob", not_before=at(second_start)
        )
        assert ready is not None, "the second user's session never became SSH-ready"
        assert ready - at(second_start) <= 2.0
        # the hostile session is gone by its end + grace + a few seconds
        limit = at(hostile_end) + config.daemon.stop_grace.total_seconds() + 5
        while time.monotonic() < limit and any(
            c.labels.get("gpuresa.reservation") == "hostile" for c in docker_harness.ours()
        ):
            time.sleep(0.1)
        left = [
            c.name
            for c in docker_harness.ours()
            if c.labels.get("gpuresa.reservation") == "hostile"
        ]
        assert left == []

        # its output, copied out of its image and handed over once the containers are gone
        def outputs() -> list[Path]:
            # not the copy being read out of its image in the hidden store, which the
            # daemon renames and removes while this walks: that folder is never entered
            found = []
            for folder, subfolders, files in os.walk(tmp_path / "output"):
                subfolders[:] = [name for name in subfolders if name != ".running-store"]
                found += [Path(folder) / name for name in files if name == "result.txt"]
            return found

        wait_for(outputs, 30, "the hostile session's output at its final place")
        assert [path.read_text() for path in outputs()] == ["saved\n"]
    finally:
        daemon.stop()


def test_eight_sessions_booked_for_the_same_minute_are_all_ready_within_two_seconds(
    tmp_path: Path, docker_harness: DockerHarness, relay: HangingRelay, daemon_log: Path
) -> None:
    config_file = write_config(tmp_path, 8, relay.port)
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=25)
    keys = [f"nine-{index}" for index in range(8)]
    book_at_once(tmp_path, keys, start)
    daemon = DaemonProcess(config_file, daemon_log)
    try:
        latencies = start_latencies(config, keys, start)
        assert all(latency is not None for latency in latencies.values()), latencies
        assert max(latency for latency in latencies.values() if latency is not None) <= 2.0, (
            latencies
        )
    finally:
        daemon.stop()


def test_sigterm_ends_the_daemon_within_five_seconds_while_a_stop_is_stuck(
    tmp_path: Path, docker_harness: DockerHarness, relay: HangingRelay, daemon_log: Path
) -> None:
    config_file = write_config(tmp_path, 1, relay.port)
    config_file.write_text(
        config_file.read_text().replace('stop_grace = "2s"', 'stop_grace = "60s"')
    )
    config = load_config(config_file)
    now = datetime.now(UTC).replace(microsecond=0)
    end = now + timedelta(seconds=12)
    (tmp_path / "calendar" / "stuck.ics").write_text(ics_event("stuck", now, end, "alice", ""))
    daemon = DaemonProcess(config_file, daemon_log)
    try:
        assert wait_ssh_ready(config, "stuck", time.monotonic() + 30) is not None
        main = next(c for c in docker_harness.ours() if c.labels["gpuresa.role"] == "main")
        main.exec_run(
            ["sh", "-c", "trap '' TERM; exec tail -f /dev/null"], user="alice", detach=True
        )
        # the stop begins at the end and waits up to its 60 s grace for that process
        wait_for(
            lambda: "stop stuck" in daemon_log.read_text(),
            (end - datetime.now(UTC)).total_seconds() + 30,
            "the stop to begin",
        )
        assert daemon.process.poll() is None
        sent = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        daemon.process.wait(10)
        assert time.monotonic() - sent <= 5.0
        assert daemon.process.returncode == 0
    finally:
        daemon.stop()
