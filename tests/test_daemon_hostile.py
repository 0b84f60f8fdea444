"""Every booking on time, whatever one user or one outside system does.

Real Docker, real sshd in the sessions, a real SMTP relay that hangs. The
daemon runs as its own process (`gpuresa run`), as under systemd.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import BASE_IMAGE, TEST_HOST, DockerHarness
from test_daemon_cli import ics_event

from gpuresa.config import Config, load_config
from gpuresa.demo import free_port_block
from gpuresa.runtime import Runtime
from gpuresa.runtime.probes import ssh_handshake

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
    calendar = directory / "calendar"
    calendar.mkdir()
    keys = directory / "keys"
    keys.mkdir()
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "key")], check=True
    )
    for user in ("alice", "bob"):
        (keys / f"{user}.pub").write_text((directory / "key.pub").read_text())
    size = 4 * sessions
    first = free_port_block(size + 2 * sessions, random.randint(40000, 60000))
    config = directory / "config.toml"
    config.write_text(
        f"""
[daemon]
host = "{TEST_HOST}"
state_dir = "{directory / "state"}"
poll_interval = "1s"
prepare_ahead = "20s"
stop_grace = "2s"
warnings = ["20s"]
{daemon_extra}
[[calendars]]
name = "folder"
kind = "ics"
url = "{calendar}"
host = "{TEST_HOST}"
default_template = "pytorch"
[[hosts]]
name = "{TEST_HOST}"
gpus = []
gpu_mode = "none"
bind_address = "127.0.0.1"
ssh_ports = "{first}-{first + sessions - 1}"
ftp_ports = "{first + sessions}-{first + 2 * sessions - 1}"
ftp_passive_ports = "{first + 2 * sessions}-{first + 2 * sessions + size - 1}"
ftp_passive_per_session = 4
[templates]
base_image = "{BASE_IMAGE}"
[users]
keys_dir = "{keys}"
host_authorized_keys = false
[storage]
output_root = "{directory / "output"}"
[limits]
shm_size = "64m"
pids = 256
[notify]
enabled = true
smtp_host = "127.0.0.1"
smtp_port = {relay_port}
timeout = "60s"
[users.emails]
alice = "alice@example.org"
bob = "bob@example.org"
"""
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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


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


def wait_ssh_ready(config: Config, key: str, deadline: float) -> float | None:
    """The monotonic time at which session `key`'s sshd first completed a key exchange."""
    runtime = Runtime(config)
    port = None
    while time.monotonic() < deadline:
        if port is None:
            session = next((item for item in runtime.list_sessions() if item.key == key), None)
            port = session.ssh_port if session is not None else None
        if port is not None and ssh_handshake("127.0.0.1", port, 0.5):
            return time.monotonic()
        time.sleep(0.05)
    return None


def at(instant: datetime) -> float:
    """The monotonic time of a wall-clock instant (near now)."""
    return time.monotonic() + (instant - datetime.now(UTC)).total_seconds()


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
        script = "; ".join(
            [
                f"for d in /usr/bin /bin /usr/sbin /sbin; do [ -e $d/{program} ] && "
                f"printf '%s' \"$HANG\" > $d/{program} && chmod 755 $d/{program}; done"
                for program in REPLACED
            ]
            + ["true"]
        )
        code, output = main.exec_run(["sh", "-c", script], environment={"HANG": NEVER_RETURNS})
        assert code == 0, output
        main.exec_run(
            ["sh", "-c", "trap '' TERM; echo saved > /output/result.txt; exec tail -f /dev/null"],
            user="alice",
            detach=True,
        )
        main.exec_run(
            ["sudo", "sh", "-c", "trap '' TERM; exec tail -f /dev/null"], user="alice", detach=True
        )
        ready = wait_ssh_ready(config, "second", at(second_start) + 15)
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
        outputs = list((tmp_path / "output").rglob("result.txt"))
        assert [path.read_text() for path in outputs] == ["saved\n"]
    finally:
        daemon.stop()


def test_eight_sessions_booked_for_the_same_minute_are_all_ready_within_two_seconds(
    tmp_path: Path, docker_harness: DockerHarness, relay: HangingRelay, daemon_log: Path
) -> None:
    config_file = write_config(tmp_path, 8, relay.port)
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=25)
    keys = [f"nine-{index}" for index in range(8)]
    for key in keys:
        (tmp_path / "calendar" / f"{key}.ics").write_text(
            ics_event(key, start, start + timedelta(minutes=30), "alice", "")
        )
    daemon = DaemonProcess(config_file, daemon_log)
    try:
        readiness: dict[str, float | None] = {}
        threads = [
            threading.Thread(
                target=lambda key=key: readiness.__setitem__(
                    key, wait_ssh_ready(config, key, at(start) + 30)
                )
            )
            for key in keys
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        latencies = {
            key: None if ready is None else ready - at(start) for key, ready in readiness.items()
        }
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
        time.sleep(max((end - datetime.now(UTC)).total_seconds(), 0) + 2)
        assert daemon.process.poll() is None
        assert "stop stuck" in daemon_log.read_text()
        sent = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        daemon.process.wait(10)
        assert time.monotonic() - sent <= 5.0
        assert daemon.process.returncode == 0
    finally:
        daemon.stop()
