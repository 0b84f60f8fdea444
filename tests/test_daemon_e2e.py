"""End to end: real Radicale, real Docker (and Podman), real SMTP, the daemon as its own process.

Bookings are made with the caldav client, users log in with paramiko, and the
daemon is killed with SIGKILL mid-session, as an admin's worst day would go.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import paramiko
import pytest
from conftest import (
    BASE_IMAGE,
    PODMAN_SOCKET,
    TEST_HOST,
    DockerHarness,
    RadicaleServer,
    SMTPServer,
)
from support.configs import free_ports
from support.logins import run, sftp_login, try_login
from support.waiting import polls_later, wait_for

from gpuresa.backends.engines import Runtime
from gpuresa.backends.engines.output_service import OutputService
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.journal.store import Journal
from gpuresa.model import Session
from gpuresa.outputs.running_area import running_path


def port_block(size: int) -> int:
    """The first of `size` consecutive free ports on 127.0.0.1."""
    return free_ports(size)


@dataclass
class Stack:
    """A configured daemon, its calendar and what it talks to."""

    config_file: Path
    config: Config
    calendar: Any
    radicale: RadicaleServer
    smtp: SMTPServer
    key_file: Path
    output_root: Path
    log_file: Path
    process: subprocess.Popen[bytes] | None = None

    def start_daemon(self) -> None:
        log = self.log_file.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpuresa.cli", "--config", str(self.config_file), "-v", "run"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def kill_daemon(self, sig: int = signal.SIGKILL) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        self.process.wait(20)

    def sessions(self) -> list[Session]:
        return Runtime(self.config).list_sessions()

    def session(self, key: str) -> Session | None:
        return next((session for session in self.sessions() if session.key == key), None)

    def book(self, uid: str, start: datetime, end: datetime, summary: str, description: str) -> Any:
        return self.calendar.save_event(
            dtstart=start, dtend=end, summary=summary, description=description, uid=uid
        )

    def login(self, port: int, user: str = "alice") -> paramiko.SSHClient | None:
        """An SSH client logged in with the user's key, or None if the login fails now."""
        return try_login(port, user, self.key_file)

    def state(self, key: str) -> str | None:
        """The journal's state of booking `key` now (read-only, beside the daemon)."""
        journal = Journal(self.config.daemon.state_dir / "journal.sqlite", read_only=True)
        with contextlib.closing(journal):
            return journal.states.get(key)

    def timed_login(
        self, port: int, user: str = "alice"
    ) -> tuple[paramiko.SSHClient, datetime] | None:
        """A logged-in client and when its attempt began (the session answered by then:
        the handshake's own time on a loaded machine is not the daemon's), or None."""
        began = datetime.now(UTC)
        client = self.login(port, user)
        return None if client is None else (client, began)


def download(stack: Stack, path: str) -> bytes:
    """A file of alice's outputs, over SFTP from the host's output service, with her key."""
    with (
        sftp_login(stack.config.storage.sftp_port, "alice", stack.key_file) as sftp,
        sftp.open(path) as stream,
    ):
        return bytes(stream.read())


@pytest.fixture
def stack(
    tmp_path: Path,
    radicale_private: RadicaleServer,
    smtp_server: SMTPServer,
    docker_harness: DockerHarness,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    yield from make_stack(tmp_path, radicale_private, smtp_server, docker_harness, request)


@pytest.fixture
def podman_stack(
    tmp_path: Path,
    radicale_private: RadicaleServer,
    smtp_server: SMTPServer,
    podman_harness: DockerHarness,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    # prepared from the daemon's start, as the default `prepare_ahead` (5 min) does in
    # service: Podman's prepare has taken 7 s of an 8 s lead with two workers beside it
    yield from make_stack(
        tmp_path, radicale_private, smtp_server, podman_harness, request, prepare_ahead="60s"
    )


def make_stack(
    tmp_path: Path,
    radicale_private: RadicaleServer,
    smtp_server: SMTPServer,
    harness: DockerHarness,
    request: pytest.FixtureRequest,
    prepare_ahead: str = "8s",
) -> Iterator[Stack]:
    """A daemon's config on `harness`'s engine, with its calendar, keys and folders."""
    engine = f'engine = "{harness.engine}"\nengine_socket = "{PODMAN_SOCKET}"'
    keys = tmp_path / "keys"
    keys.mkdir()
    key_file = tmp_path / "alice_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key_file)], check=True)
    (keys / "alice.pub").write_text(key_file.with_suffix(".pub").read_text())
    inputs = tmp_path / "input"
    inputs.mkdir()
    (inputs / "dataset.txt").write_text("input data\n")
    output_root = tmp_path / "output"
    # One block for all three ranges: three random blocks could overlap.
    ssh_first = port_block(31)
    ftp_first, passive_first = ssh_first + 5, ssh_first + 10
    calendar = radicale_private.new_calendar("gpu")
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f"""
[daemon]
host = "{TEST_HOST}"
state_dir = "{tmp_path / "state"}"
poll_interval = "2s"
prepare_ahead = "{prepare_ahead}"
stop_grace = "2s"
cancel_grace = "6s"
orphan_grace = "1m"
warnings = ["20s"]

[[calendars]]
name = "gpu"
kind = "caldav"
url = "{calendar.url}"
username = "{radicale_private.username}"
password_file = "{radicale_private.password_file}"
host = "{TEST_HOST}"
default_template = "pytorch"

[[hosts]]
name = "{TEST_HOST}"
{engine if harness.engine == "podman" else ""}
gpus = [0, 1]
gpu_mode = "none"
bind_address = "127.0.0.1"
public_name = "127.0.0.1"
ssh_ports = "{ssh_first}-{ssh_first + 4}"
ftp_ports = "{ftp_first}-{ftp_first + 4}"
ftp_passive_ports = "{passive_first}-{passive_first + 19}"
ftp_passive_per_session = 5

[templates]
base_image = "{BASE_IMAGE}"

[users]
keys_dir = "{keys}"
host_authorized_keys = false
emails = {{ alice = "alice@example.org" }}

[storage]
output_root = "{output_root}"
sftp_port = {ssh_first + 30}
[[storage.inputs]]
source = "{inputs}"
target = "/data"

[limits]
shm_size = "64m"

[notify]
enabled = true
smtp_host = "127.0.0.1"
smtp_port = {smtp_server.port}
sender = "gpuresa@example.org"
admin = "admins@example.org"
"""
    )
    config = load_config(config_file)
    # build the template image now, so no test waits for a build at its start time
    Runtime(config).ensure_image("pytorch", None)
    Runtime(config).ensure_ftp_image()  # starts never build images
    OutputService(config, Runtime(config)).ensure_image()
    stack = Stack(
        config_file=config_file,
        config=config,
        calendar=calendar,
        radicale=radicale_private,
        smtp=smtp_server,
        key_file=key_file,
        output_root=output_root,
        log_file=tmp_path / "daemon.log",
    )
    yield stack
    if stack.process is not None and stack.process.poll() is None:
        stack.kill_daemon(signal.SIGTERM)
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print("===== daemon log =====")
        print(stack.log_file.read_text(errors="replace")[-20000:])


def next_second(delay: float) -> datetime:
    moment = datetime.now(UTC) + timedelta(seconds=delay)
    return moment.replace(microsecond=0) + timedelta(seconds=1)


def subjects(smtp: SMTPServer) -> list[str]:
    return [str(message["Subject"]) for message in smtp.messages]


def mail_matching(smtp: SMTPServer, word: str, timeout: float = 20) -> Any:
    return wait_for(
        lambda: next(
            (message for message in smtp.messages if word in str(message["Subject"]).lower()),
            None,
        ),
        timeout,
        f"an e-mail about {word!r} (got {subjects(smtp)})",
    )


def test_booking_lifecycle_with_extension_kill_and_calendar_outage(
    stack: Stack, docker_harness: DockerHarness
) -> None:
    start = next_second(12)
    end = start + timedelta(seconds=35)
    event = stack.book("lifecycle-1", start, end, "alice", "template: pytorch\ngpus: 1")
    stack.start_daemon()

    # prepared ahead: containers exist before the start, with their ports chosen
    prepared = wait_for(lambda: stack.session("lifecycle-1"), 15, "the prepared session")
    assert datetime.now(UTC) < start
    port = prepared.ssh_port

    # SSH-ready within 2 s of the start time: the login that got in began by then
    client, ready = wait_for(
        lambda: stack.timed_login(port),
        (start - datetime.now(UTC)).total_seconds() + 10,
        "an SSH login",
    )
    assert ready - start <= timedelta(seconds=2), f"ready {ready - start} after the start"
    status, output = run(client, "sudo -n id -u && cat /data/dataset.txt")
    assert status == 0 and output.split() == ["0", "input", "data"]
    status, _ = run(client, "echo result > /output/result.txt")
    assert status == 0
    client.close()

    notice = mail_matching(stack.smtp, "ready")
    body = notice.get_content()
    assert f"ssh -p {port} alice@127.0.0.1" in body
    assert notice["To"] == "alice@example.org"

    # extended while running: the session keeps going past the old end
    component = event.icalendar_component
    new_end = end + timedelta(seconds=20)
    component["DTEND"].dt = new_end
    event.save()

    # SIGKILL mid-session, once it polled the extension, then a restart: adopted, not
    # started twice however many rounds the new daemon plans
    polls_later(stack.config, 2)
    stack.kill_daemon()
    stack.start_daemon()
    polls_later(stack.config, 2)
    sessions = [session for session in stack.sessions() if session.key == "lifecycle-1"]
    assert len(sessions) == 1 and sessions[0].ssh_port == port
    assert len(docker_harness.sessions()) == 2  # the main container and its FTP sidecar

    # the calendar server goes away: the session still runs to its (new) end
    stack.radicale.stop()
    wait_for(lambda: datetime.now(UTC) > end + timedelta(seconds=3), 60, "the old end to pass")
    late_client = stack.login(port)
    assert late_client is not None, "the session stopped at the old end or because of the outage"
    late_client.close()
    assert stack.session("lifecycle-1") is not None
    mail_matching(stack.smtp, "ends")  # the 20 s warning

    grace = stack.config.daemon.stop_grace
    gone = wait_for(
        lambda: None if stack.session("lifecycle-1") else datetime.now(UTC),
        (new_end - datetime.now(UTC) + grace).total_seconds() + 15,
        "the session to be removed",
    )
    assert gone >= new_end
    assert gone - (new_end + grace) <= timedelta(seconds=2), f"gone {gone - new_end} after end"
    # nothing of the session is left; the host's output service stays
    left = [container.labels.get("gpuresa.role") for container in docker_harness.ours()]
    assert left == ["outputs"]
    # the end notice (sent once the output is handed over) says how to download it, and
    # until when; the output service serves it then, with no host account
    ended = mail_matching(stack.smtp, "ended")
    outputs = list((stack.output_root / "alice").rglob("result.txt"))
    assert len(outputs) == 1 and outputs[0].read_text() == "result\n"
    port = stack.config.storage.sftp_port
    assert f"sftp -P {port} alice@" in ended.get_content() and "removed on" in ended.get_content()
    assert download(stack, f"{outputs[0].parent.name}/result.txt") == b"result\n"
    # the start notice gives the lines that trust every session of the host: one per
    # port (the session ports and the output service's), none for any port
    started = mail_matching(stack.smtp, "ready")
    authority = [line for line in started.get_content().splitlines() if "@cert-authority" in line]
    host = stack.config.host()
    assert len(authority) == len(host.ssh_ports) + 1
    assert all("]:* " not in line for line in authority)
    assert any(f"]:{port} ssh-ed25519 " in line for line in authority)
    assert "SHA256:" not in started.get_content().split("FTPS certificate")[0]


def test_cancelled_and_rejected_bookings(stack: Stack) -> None:
    start = next_second(6)
    event = stack.book(
        "cancel-1", start, start + timedelta(minutes=10), "alice", "template: pytorch"
    )
    stack.book(
        "reject-1", start, start + timedelta(minutes=10), "alice", "template: no-such-template"
    )
    stack.start_daemon()

    rejection = mail_matching(stack.smtp, "rejected")
    assert "no-such-template" in rejection.get_content()
    session = wait_for(lambda: stack.session("cancel-1"), 20, "the session to run")
    client = wait_for(lambda: stack.login(session.ssh_port), 20, "an SSH login")
    client.close()

    event.delete()
    deleted = datetime.now(UTC)
    mail_matching(stack.smtp, "cancel")
    grace = stack.config.daemon.cancel_grace
    poll = stack.config.daemon.poll_interval
    gone = wait_for(
        lambda: None if stack.session("cancel-1") else datetime.now(UTC),
        (grace + poll).total_seconds() + 20,
        "the cancelled session to stop",
    )
    assert gone - deleted >= grace
    assert gone - deleted <= grace + poll + timedelta(seconds=4)
    # the containers are gone before the stop's hand-over and journal lines are done
    wait_for(lambda: stack.state("cancel-1") == "cancelled", 30, "the stop to be journalled")

    stack.kill_daemon(signal.SIGTERM)
    journal = Journal(stack.config.daemon.state_dir / "journal.sqlite", read_only=True)
    with contextlib.closing(journal):
        assert journal.states.get("reject-1") == "rejected"
        assert journal.states.get("cancel-1") == "cancelled"
        rejected = [entry for entry in journal.history.entries() if entry.key == "reject-1"]
        assert any("no-such-template" in entry.detail for entry in rejected)


def test_a_booking_on_podman_runs_in_its_own_user_namespace_and_survives_a_kill(
    podman_stack: Stack, podman_harness: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = podman_stack
    # time for a daemon starting on a loaded machine to prepare it ahead (from its start:
    # `podman_stack`), as in service (Podman has taken 29 s from the daemon's start with
    # two other workers' tests beside it)
    start = next_second(40)
    # long enough for a login, a kill and a restart on a loaded machine before its end
    end = start + timedelta(seconds=30)
    stack.book("podman-1", start, end, "alice", "template: pytorch")
    stack.start_daemon()
    prepared = wait_for(lambda: stack.session("podman-1"), 45, "the prepared session")
    assert datetime.now(UTC) < start, "prepared only after its start"
    port = prepared.ssh_port
    client, ready = wait_for(
        lambda: stack.timed_login(port),
        (start - datetime.now(UTC)).total_seconds() + 10,
        "an SSH login",
    )
    # the 2 s promise is held on Docker above; here, a margin for a loaded machine
    assert ready - start <= timedelta(seconds=4), f"ready {ready - start} after the start"
    status, output = run(client, "sudo -n id -u && cat /data/dataset.txt && id -u")
    assert status == 0 and output.split()[:3] == ["0", "input", "data"]
    uid = int(output.split()[3])
    assert run(client, "echo result > /output/result.txt")[0] == 0
    client.close()

    # SIGKILL mid-session, then a restart: adopted with its range, not started twice
    stack.kill_daemon()
    stack.start_daemon()
    polls_later(stack.config, 2)
    (session,) = [session for session in stack.sessions() if session.key == "podman-1"]
    assert session.ssh_port == port and session.id_range is not None
    assert len(podman_harness.sessions()) == 2
    # written from inside, owned by the login's id in this session's own range
    written = running_path(stack.config, "podman-1") / "result.txt"
    assert written.stat().st_uid == session.id_range.uid + uid
    from gpuresa.cli import main

    assert main(["status", "--config", str(stack.config_file), "--json"]) == 0
    assert datetime.now(UTC) < end, "the session ended before its status was read"
    assert str(session.id_range) in capsys.readouterr().out

    grace = stack.config.daemon.stop_grace
    wait_for(
        lambda: None if stack.session("podman-1") else datetime.now(UTC),
        (end - datetime.now(UTC) + grace).total_seconds() + 15,
        "the session to be removed",
    )
    assert podman_harness.sessions() == []
    # after the end (told once the hand-over is done) it is the login's, not the
    # range's: the output service serves it. The notice follows the removal, which may wait
    # (up to 30 s on a loaded machine) for Podman to let go of the session's ports
    mail_matching(stack.smtp, "ended", timeout=45)
    (result,) = (stack.output_root / "alice").rglob("result.txt")
    assert result.read_text() == "result\n"
    assert result.stat().st_uid != session.id_range.uid + uid
    assert download(stack, f"{result.parent.name}/result.txt") == b"result\n"
