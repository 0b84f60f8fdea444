"""The daemon when the Docker engine does not answer: it waits, retries, and catches up.

The daemon reaches the engine through a socket path that does not exist at
first; making it a link to the real socket is the engine "coming back".
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import docker
import pytest
from conftest import TEST_HOST, DockerHarness, SMTPServer, free_port
from support.waiting import polls_later, wait_for
from test_daemon_cli import ics_event, write_ics_config

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.daemon import Daemon, session_record
from gpuresa.errors import UserError
from gpuresa.journal.store import Journal
from gpuresa.mail.smtp import Notifier
from gpuresa.reservations.catalog import SHIPPED_TEMPLATES
from gpuresa.sessions.labels import session_name


def wait_until_running(daemon: Daemon, key: str, timeout: float) -> None:
    """Wait until the journal says the session of `key` runs; fail the test after `timeout`."""
    wait_for(lambda: daemon.journal.states.get(key) == "running", timeout, f"session {key} to run")


def test_daemon_waits_for_docker_and_starts_the_session_when_it_is_back(
    tmp_path: Path, docker_harness: DockerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = write_ics_config(tmp_path, 'docker_retry_max = "2s"')
    calendar = tmp_path / "calendar"
    config = load_config(config_file)
    real = Runtime(config, docker.from_env())
    start = datetime.now(UTC).replace(microsecond=0)
    (calendar / "a.ics").write_text(
        ics_event("outage-1", start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )

    link = tmp_path / "docker.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{link}")
    daemon = Daemon(config)
    daemon.start()
    try:
        # nothing could start, nothing crashed, and the retries back off
        wait_for(lambda: daemon.docker_backoff > timedelta(seconds=1), 20, "a longer back-off")
        assert real.list_sessions() == []
        assert daemon.journal.states.get("outage-1") == "booked"

        os.symlink("/var/run/docker.sock", link)
        wait_until_running(daemon, "outage-1", 20)
        assert [(session.key, session.state) for session in real.list_sessions()] == [
            ("outage-1", "running")
        ]
        assert daemon.docker_backoff == timedelta(seconds=1)
    finally:
        daemon.shutdown()


def test_a_second_daemon_on_the_same_state_directory_is_refused(tmp_path: Path) -> None:
    config = load_config(write_ics_config(tmp_path))
    first = Daemon(config)
    first.start()
    try:
        second = Daemon(config)
        with pytest.raises(UserError, match="another gpuresa daemon"):
            second.start()
    finally:
        first.shutdown()


def test_a_start_notice_that_could_not_be_sent_is_sent_later(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer
) -> None:
    closed_port = free_port()
    config_file = write_ics_config(tmp_path)
    text = config_file.read_text() + (
        f'[notify]\nenabled = true\nsmtp_host = "127.0.0.1"\nsmtp_port = {closed_port}\n'
        'timeout = "2s"\n[users.emails]\nalice = "alice@example.org"\n'
    )
    text = text.replace("[users]\n", "[users]\n", 1)
    config_file.write_text(text)
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0)
    (tmp_path / "calendar" / "a.ics").write_text(
        ics_event("notice-1", start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )
    daemon = Daemon(config)
    daemon.start()
    try:
        wait_until_running(daemon, "notice-1", 30)
        assert daemon.outbox is not None
        outbox = daemon.outbox
        # the SMTP server was unreachable: the notice waits in the outbox with its error
        wait_for(
            lambda: any(message.attempts for message in outbox.pending()),
            20,
            "a failed attempt in the outbox",
        )
        [waiting] = outbox.pending()
        assert (waiting.key, waiting.attempts) == ("notice-1", 1)
        assert waiting.kind is not None and waiting.kind.startswith("start")
        assert not outbox.sent("notice-1", waiting.kind)
        # the server is back; the retry after the first back-off sends it, once
        outbox.set_notifier(
            Notifier(dataclasses.replace(config.notify, smtp_port=smtp_server.port), config.users)
        )
        messages = smtp_server.wait_for(1, timeout=30)
        assert "ready" in str(messages[0]["Subject"])
        kind = waiting.kind
        wait_for(lambda: outbox.sent("notice-1", kind), 5, "the notice to be marked sent")
        # two polls and their rounds later, with nothing left to send: still one
        polls_later(config, 2)
        assert outbox.backlog() == 0
        assert len(smtp_server.messages) == 1
    finally:
        daemon.shutdown()


def test_a_crashed_ftp_sidecar_is_restarted_without_touching_the_users_container(
    tmp_path: Path, docker_harness: DockerHarness
) -> None:
    config = load_config(write_ics_config(tmp_path))
    start = datetime.now(UTC).replace(microsecond=0)
    (tmp_path / "calendar" / "a.ics").write_text(
        ics_event("sidecar-1", start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )
    daemon = Daemon(config)
    daemon.start()
    try:
        wait_until_running(daemon, "sidecar-1", 30)
        containers = {
            container.labels["gpuresa.role"]: container for container in docker_harness.ours()
        }
        main, sidecar = containers["main"], containers["ftp"]
        main_started = main.attrs["State"]["StartedAt"]
        sidecar.kill()

        def sidecar_running() -> bool:
            sidecar.reload()
            return bool(sidecar.status == "running")

        wait_for(sidecar_running, 20, "the sidecar to run again")
        main.reload()
        assert main.status == "running"
        assert main.attrs["State"]["StartedAt"] == main_started
    finally:
        daemon.shutdown()


def test_sessions_ending_together_stop_side_by_side(
    tmp_path: Path, docker_harness: DockerHarness
) -> None:
    config_file = write_ics_config(tmp_path, 'warnings = ["1h"]')
    config_file.write_text(
        config_file.read_text().replace('stop_grace = "1s"', 'stop_grace = "6s"')
    )
    config = load_config(config_file)
    grace = config.daemon.stop_grace.total_seconds()
    start = datetime.now(UTC).replace(microsecond=0)
    end = start + timedelta(seconds=20)
    for key in ("together-1", "together-2"):
        (tmp_path / "calendar" / f"{key}.ics").write_text(
            ics_event(key, start, end, "alice", "gpus: 1")
        )
    daemon = Daemon(config)
    daemon.start()
    try:
        wait_for(
            lambda: all(
                daemon.journal.states.get(key) in ("running", "warned")
                for key in ("together-1", "together-2")
            ),
            30,
            "both sessions to run",
        )
        mains = [c for c in docker_harness.ours() if c.labels["gpuresa.role"] == "main"]
        assert len(mains) == 2
        for main in mains:
            # a job that ignores SIGTERM: each stop waits its whole grace period
            main.exec_run(
                ["sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"],
                user="alice",
                detach=True,
            )
        gone = wait_for(
            lambda: None if docker_harness.sessions() else datetime.now(UTC),
            (end - datetime.now(UTC)).total_seconds() + 3 * grace + 10,
            "both sessions to be removed",
        )
        # one grace period for both, not one after the other: stops in turn could not
        # end before two whole grace periods had passed, however fast the machine
        assert (gone - end).total_seconds() < 2 * grace
    finally:
        daemon.shutdown()


def test_a_long_image_build_does_not_hold_up_other_sessions(
    tmp_path: Path, docker_harness: DockerHarness
) -> None:
    # the shipped templates, plus "slow": pytorch with a build step that takes a while
    templates = tmp_path / "templates"
    shutil.copytree(SHIPPED_TEMPLATES, templates)
    shutil.copytree(templates / "pytorch", templates / "slow")
    with (templates / "slow" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"RUN sleep 8 && echo {uuid.uuid4().hex} > /etc/build-id\n")
    config_file = write_ics_config(tmp_path)
    config_file.write_text(
        config_file.read_text().replace(
            "[templates]\n",
            f'[templates]\ndirectory = "{templates}"\nallowed = ["pytorch", "slow"]\n',
        )
    )
    config = load_config(config_file)
    Runtime(config).ensure_image("pytorch", None)
    Runtime(config).ensure_ftp_image()  # starts never build images
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=3)
    end = start + timedelta(minutes=30)
    calendar = tmp_path / "calendar"
    (calendar / "slow.ics").write_text(ics_event("slow-1", start, end, "alice", "template: slow"))
    (calendar / "quick.ics").write_text(
        ics_event("quick-1", start, end, "alice", "template: pytorch")
    )
    daemon = Daemon(config)
    daemon.start()
    try:
        deadline = time.monotonic() + 60
        wait_until_running(daemon, "quick-1", 60)
        quick_ready = datetime.now(UTC)
        # the other booking's 8 s build runs meanwhile, outside the reconcile lock: the
        # quick one is not held up by it (the 2 s promise itself is timed in
        # test_daemon_e2e; here, half the build's time leaves a loaded machine its margin)
        assert quick_ready - start <= timedelta(seconds=4)
        assert daemon.journal.states.get("slow-1") != "running"
        wait_until_running(daemon, "slow-1", deadline - time.monotonic())
    finally:
        daemon.shutdown()
        docker_harness.remove_all()
        slow = docker_harness.client.images.list(filters={"label": "gpuresa.template=slow"})
        # an image built on another (which inherits its labels) goes first
        for image in sorted(slow, key=lambda item: item.attrs["Created"], reverse=True):
            docker_harness.client.images.remove(image.id, force=True)


@pytest.mark.parametrize("told", [True, False], ids=["told", "untold"])
def test_a_stop_interrupted_after_the_containers_went_is_finished_at_the_next_start(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer, told: bool
) -> None:
    config_file = write_ics_config(tmp_path)
    config_file.write_text(
        config_file.read_text()
        + f'[notify]\nenabled = true\nsmtp_host = "127.0.0.1"\nsmtp_port = {smtp_server.port}\n'
        + '[users.emails]\nalice = "alice@example.org"\n'
    )
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0)
    booking = tmp_path / "calendar" / "a.ics"
    booking.write_text(ics_event("cut-1", start, start + timedelta(minutes=30), "alice", ""))
    first = Daemon(config)
    first.start()
    try:
        wait_until_running(first, "cut-1", 30)
    finally:
        first.shutdown()
    session = Runtime(config).list_sessions()[0]
    # the daemon died in the middle of this stop: containers gone, the network left,
    # nothing told yet (a session never started, or one whose stop needs no notice, has
    # no record of what to tell: only the stop's reason)
    journal = Journal(config.daemon.state_dir / "journal.sqlite")
    journal.states.set("cut-1", "stopping", datetime.now(UTC), "ended")
    journal.facts.set("unwinding:cut-1", "ended")
    if told:
        journal.facts.set("stopping:cut-1", session_record(session, "ended"))
    journal.close()
    for container in docker_harness.ours():
        container.remove(force=True)
    network = session_name(TEST_HOST, "cut-1")
    assert docker_harness.client.networks.list(names=[network])
    booking.unlink()

    second = Daemon(config)
    second.start()
    try:
        if told:
            # (the first daemon's ready notice may still be in the outbox: sent first)
            ended = wait_for(
                lambda: [m for m in smtp_server.messages if "has ended" in str(m["Subject"])],
                30,
                "the end notice",
            )
            assert len(ended) == 1
            assert str(session.output_dir) in ended[0].get_content()
        # finished in the first round, not by the hourly maintenance
        wait_for(
            lambda: second.journal.facts.get("unwinding:cut-1") is None,
            20,
            "the interrupted stop to be finished",
        )
        assert second.journal.facts.get("stopping:cut-1") is None
        assert second.journal.states.get("cut-1") == "ended"
        assert not docker_harness.client.networks.list(names=[network])
    finally:
        second.shutdown()
