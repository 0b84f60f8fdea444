"""No-shows on Docker: a booked session nobody logs into is warned, released, its GPUs lent.

A real daemon (in-process) on a host with two stand-in GPUs (`support.gpu_nodes`)
that releases sessions nobody logged into 24 s after their start (warned 8 s
before); bookings come from an ICS folder, notices go to a real SMTP server,
users log in over SSH. A login, even one that leaves at once, keeps a session.
"""

from __future__ import annotations

import email.message
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import TEST_HOST, DockerHarness, SMTPServer
from support.configs import write_daemon_config
from support.gpu_nodes import stand_in_driver, stand_in_gpu_nodes
from support.logins import try_login
from support.waiting import wait_for
from test_daemon_cli import ics_event

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.daemon import Daemon
from gpuresa.model import Session

UNUSED = timedelta(seconds=24)
NOTICE = timedelta(seconds=8)


@dataclass
class Stage:
    config: Config
    daemon: Daemon
    runtime: Runtime
    smtp: SMTPServer
    harness: DockerHarness
    key_file: Path

    def book(self, key: str, start: datetime, end: datetime, user: str) -> None:
        folder = Path(self.config.calendars[0].url)
        (folder / f"{key}.ics").write_text(ics_event(key, start, end, user, "gpus: 1"))

    def session(self, key: str) -> Session | None:
        return next((item for item in self.runtime.list_sessions() if item.key == key), None)

    def state(self, key: str) -> str | None:
        return self.daemon.journal.states.get(key)

    def running(self, key: str, timeout: float) -> Session:
        wait_for(lambda: self.state(key) == "running", timeout, f"session {key} to run")
        session = self.session(key)
        assert session is not None
        return session

    def mail(self, user: str, subject: str) -> email.message.EmailMessage | None:
        return next(
            (
                message
                for message in list(self.smtp.messages)
                if message["To"] == f"{user}@example.org" and subject in str(message["Subject"])
            ),
            None,
        )

    def shown(self, key: str) -> str:
        """The session's last message, read from outside (no login)."""
        (main,) = [
            container
            for container in self.harness.ours()
            if container.labels.get("gpuresa.reservation") == key
            and container.labels.get("gpuresa.role") == "main"
        ]
        code, output = main.exec_run(["cat", "/etc/gpuresa/session/message"])
        return output.decode() if code == 0 else ""


@pytest.fixture
def stage(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer
) -> Iterator[Stage]:
    libraries, smi = stand_in_driver(tmp_path / "driver")
    config_file = write_daemon_config(
        tmp_path,
        host=TEST_HOST,
        sessions=3,
        gpus=(0, 1),
        gpu_mode="devices",
        users=("alice", "bob"),
        daemon=f'release_notice = "{int(NOTICE.total_seconds())}s"',
        host_lines=(
            f'driver_libraries = ["{libraries}"]\ndriver_binaries = ["{smi}"]\n'
            f'release_unused = "{int(UNUSED.total_seconds())}s"'
        ),
        extra=f"""[telemetry]
backend = "none"
[notify]
enabled = true
smtp_host = "127.0.0.1"
smtp_port = {smtp_server.port}
[users.emails]
alice = "alice@example.org"
bob = "bob@example.org"
""",
    )
    config = load_config(config_file)
    runtime = Runtime(config)
    runtime.ensure_image("pytorch", None)
    runtime.ensure_ftp_image()
    with stand_in_gpu_nodes():
        daemon = Daemon(config)
        daemon.start()
        try:
            yield Stage(config, daemon, runtime, smtp_server, docker_harness, tmp_path / "key")
        finally:
            daemon.shutdown()


def test_an_unused_session_is_warned_released_and_its_gpu_taken_while_a_used_one_stays(
    stage: Stage,
) -> None:
    start = datetime.now(UTC).replace(microsecond=0)
    end = start + timedelta(hours=1)
    stage.book("absent", start, end, "alice")
    stage.book("present", start, end, "bob")
    absent = stage.running("absent", 40)
    present = stage.running("present", 40)
    # bob logs in once and leaves: that is use
    client = wait_for(lambda: try_login(present.ssh_port, "bob", stage.key_file), 20, "a login")
    client.close()

    warning = wait_for(lambda: stage.mail("alice", "unused GPU session"), 40, "the warning")
    warned = datetime.now(UTC)
    assert stage.state("absent") == "running"
    assert start + UNUSED - NOTICE - timedelta(seconds=2) <= warned < start + UNUSED + NOTICE
    assert "nobody has logged into it yet" in warning.get_content()
    assert "nobody has logged into this session" in stage.shown("absent")

    wait_for(lambda: stage.state("absent") == "released", 40, "the release")
    assert datetime.now(UTC) >= start + UNUSED
    ended = wait_for(lambda: stage.mail("alice", "ended"), 30, "alice's end notice")
    assert "because nobody had logged into it" in ended.get_content()
    wait_for(lambda: stage.session("absent") is None, 30, "the released session to go")
    # bob's session, used once, runs on past the release time
    assert stage.state("present") == "running" and stage.mail("bob", "unused") is None

    # a walk-in booked now for alice's booking's time gets her GPU; hers is not run again
    now = datetime.now(UTC).replace(microsecond=0)
    stage.book("walk-in", now, now + timedelta(minutes=30), "bob")
    walk_in = stage.running("walk-in", 40)
    assert walk_in.gpu_indices == absent.gpu_indices
    assert stage.mail("bob", "could not be") is None
    assert stage.session("absent") is None and stage.state("absent") == "released"
    assert stage.state("present") == "running"
