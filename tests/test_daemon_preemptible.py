"""Preemptible sessions on Docker: idle GPUs lent, and given back before a firm booking starts.

A real daemon (in-process) places GPUs as device nodes (the stand-ins of
`support.gpu_nodes`) on a host with GPUs 0 and 1; bookings come from an ICS
folder, notices go to a real SMTP server, users log in over SSH.
"""

from __future__ import annotations

import email.message
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import TEST_HOST, DockerHarness, SMTPServer
from daemon_stage import at, wait_ssh_ready
from support.configs import write_daemon_config
from support.gpu_nodes import stand_in_driver, stand_in_gpu_nodes
from support.logins import run, try_login
from support.waiting import polls_later, wait_for
from test_daemon_cli import ics_event

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.daemon import Daemon
from gpuresa.mail.wording import format_clock
from gpuresa.model import Session
from gpuresa.planning.preemption import STOP_MARGIN

# alice's process that saves a checkpoint when the daemon's signal comes, and one that
# does not catch it (detached, so that the login's shell returns at once)
CHECKPOINTING = (
    'nohup sh -c \'trap "echo saved > /output/checkpoint.txt" USR1; '
    "while :; do sleep 0.2; done' </dev/null >/dev/null 2>&1 & "
    "nohup sleep 600 </dev/null >/dev/null 2>&1 &"
)
PREEMPTIBLE = "gpus: 2\\npreemptible: yes"  # "\n": a line break in ICS text


@dataclass
class Stage:
    """The daemon of a host with two (stand-in) GPUs, its calendar folder and mailbox."""

    config: Config
    daemon: Daemon
    runtime: Runtime
    smtp: SMTPServer
    harness: DockerHarness
    key_file: Path

    def book(self, key: str, start: datetime, end: datetime, user: str, description: str) -> None:
        """Write (or rewrite) the booking `key` in the calendar folder."""
        folder = Path(self.config.calendars[0].url)
        (folder / f"{key}.ics").write_text(ics_event(key, start, end, user, description))

    def session(self, key: str) -> Session | None:
        return next((item for item in self.runtime.list_sessions() if item.key == key), None)

    def containers(self, key: str) -> list[Any]:
        return [c for c in self.harness.ours() if c.labels.get("gpuresa.reservation") == key]

    def state(self, key: str) -> str | None:
        return self.daemon.journal.states.get(key)

    def mail(self, user: str, subject: str) -> email.message.EmailMessage | None:
        """The first e-mail to `user` whose subject has `subject` in it, if one came."""
        return next(
            (
                message
                for message in list(self.smtp.messages)
                if message["To"] == f"{user}@example.org" and subject in str(message["Subject"])
            ),
            None,
        )

    def running(self, key: str, timeout: float) -> Session:
        """The session of `key` once the journal says it runs."""
        wait_for(lambda: self.state(key) == "running", timeout, f"session {key} to run")
        session = self.session(key)
        assert session is not None
        return session


@pytest.fixture
def stage(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer
) -> Iterator[Stage]:
    libraries, smi = stand_in_driver(tmp_path / "driver")
    config_file = write_daemon_config(
        tmp_path,
        host=TEST_HOST,
        gpus=(0, 1),
        gpu_mode="devices",
        users=("alice", "bob"),
        # a firm booking is prepared while the preemptible session still runs, as with the
        # default (5 min ahead)
        daemon='preempt_notice = "8s"\npreempt_minimum = "5s"\nprepare_ahead = "20s"',
        host_lines=(f'driver_libraries = ["{libraries}"]\ndriver_binaries = ["{smi}"]'),
        # no NVML here: the stand-in GPUs are not sampled
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
    runtime.ensure_ftp_image()  # starts never build images
    with stand_in_gpu_nodes():
        daemon = Daemon(config)
        daemon.start()
        try:
            yield Stage(config, daemon, runtime, smtp_server, docker_harness, tmp_path / "key")
        finally:
            daemon.shutdown()


def whole_second() -> datetime:
    """Now, to the second (a calendar's DTSTART has no fractions)."""
    return datetime.now(UTC).replace(microsecond=0)


def ready_after(stage: Stage, key: str, user: str, start: datetime) -> float:
    """Seconds from `start` until `user` could log in to session `key` (when the login that
    got in began); fails the test when the daemon told `user` it could not start it."""
    ready = wait_ssh_ready(stage.config, key, at(start) + 15, user=user, not_before=at(start))
    refused = stage.mail(user, "could not be started")
    assert refused is None, f"{user} was told: {refused.get_content()}"
    assert ready is not None, f"{user}'s session never became SSH-ready"
    return ready - at(start)


def test_a_preemptible_session_is_told_checkpoints_and_gives_its_gpus_back_in_time(
    stage: Stage,
) -> None:
    config = stage.config
    grace = config.daemon.stop_grace
    now = whole_second()
    stage.book("lent", now, now + timedelta(hours=1), "alice", PREEMPTIBLE)
    lent = stage.running("lent", 40)
    assert (lent.gpu_indices, lent.preemptible) == ((0, 1), True)
    started = wait_for(lambda: stage.mail("alice", "ready"), 20, "alice's start notice")
    assert "This session is preemptible" in started.get_content()
    client = wait_for(lambda: try_login(lent.ssh_port, "alice", stage.key_file), 20, "a login")
    try:
        assert run(client, CHECKPOINTING)[0] == 0

        firm_start = whole_second() + timedelta(seconds=25)
        stage.book("firm", firm_start, firm_start + timedelta(minutes=30), "bob", "gpus: 1")
        # its stop (the grace, then the removal) is over when bob's booking starts
        stop_at = firm_start - grace - STOP_MARGIN
        notice = wait_for(lambda: stage.mail("alice", "stops at"), 30, "the notice to alice")
        noticed = datetime.now(UTC)
        # it came before the stop began, and not before the notice period
        assert stage.state("lent") == "running"
        assert stop_at - config.daemon.preempt_notice - timedelta(seconds=1) <= noticed < stop_at
        clock = format_clock(stop_at, "UTC", offset=False)
        assert f"Your preemptible session on {TEST_HOST} stops at {clock}" in notice["Subject"]
        assert "Its processes that catch SIGUSR1 have just been sent it" in notice.get_content()

        # in the session, through the same login (the signal ends nothing that does not
        # catch it): the message names the stop, and the signal reached her process
        def message() -> str | None:
            text = run(client, "cat /etc/gpuresa/session/message")[1]
            return text if "a booking needs this session's GPUs" in text else None

        shown = wait_for(message, 10, "the message in the session")
        assert f"at {format_clock(stop_at, 'UTC')}" in shown
        wait_for(
            lambda: run(client, "cat /output/checkpoint.txt")[1] == "saved\n",
            10,
            "the checkpoint written on SIGUSR1",
        )
        assert run(client, "pgrep -fx 'sleep 600'")[0] == 0
    finally:
        client.close()

    # gone by the firm booking's start, which is not delayed by it
    gone = wait_for(
        lambda: None if stage.containers("lent") else datetime.now(UTC),
        (firm_start - datetime.now(UTC)).total_seconds() + 15,
        "alice's session to be removed",
    )
    assert gone <= firm_start, f"alice's session left {gone - firm_start} after bob's start"
    assert ready_after(stage, "firm", "bob", firm_start) <= 2.0
    firm = stage.session("firm")
    assert firm is not None and firm.gpu_indices == (0,)

    assert stage.state("lent") == "preempted"
    ended = wait_for(lambda: stage.mail("alice", "has ended"), 20, "alice's end notice")
    text = ended.get_content()
    assert "because a booking needed its GPUs (it was preemptible)" in text
    # it says it ended when it was stopped, not at the end it was booked for
    stopped = re.search(r"It was stopped at (.+?), before its booked end", text)
    assert stopped is not None and f"ended at {stopped[1]}." in text, text
    kept = lent.output_dir / "checkpoint.txt"
    wait_for(kept.exists, 20, "the checkpoint in alice's kept output")
    assert kept.read_text() == "saved\n"

    # GPU 1 is idle, but her booking of two does not fit, and was served once already
    polls_later(config, 3)
    assert stage.containers("lent") == []
    assert stage.state("lent") == "preempted"
    assert [session.key for session in stage.runtime.list_sessions()] == ["firm"]


def test_a_booking_turned_firm_late_still_gives_way_to_one_that_appears_at_its_start(
    stage: Stage,
) -> None:
    config = stage.config
    grace = config.daemon.stop_grace.total_seconds()
    now = whole_second()
    end = now + timedelta(hours=1)
    stage.book("lent", now, end, "alice", PREEMPTIBLE)
    stage.running("lent", 40)
    # its writer takes it back once it runs: it stays preemptible (no firm booking
    # was refused for it)
    stage.book("lent", now, end, "alice", "gpus: 2\\npreemptible: no")
    polls_later(config, 2)
    assert stage.state("lent") == "running"

    # a firm booking written 3 to 4 s before its start: no time for a notice, stopped at once
    firm_start = whole_second() + timedelta(seconds=4)
    stage.book("firm", firm_start, firm_start + timedelta(minutes=30), "bob", "gpus: 1")
    assert ready_after(stage, "firm", "bob", firm_start) <= grace + 2
    gone = wait_for(
        lambda: None if stage.containers("lent") else datetime.now(UTC),
        15,
        "alice's session to be removed",
    )
    assert gone - firm_start <= timedelta(seconds=grace + 2)
    assert stage.state("lent") == "preempted"
    ended = wait_for(lambda: stage.mail("alice", "has ended"), 20, "alice's end notice")
    assert "because a booking needed its GPUs (it was preemptible)" in ended.get_content()
