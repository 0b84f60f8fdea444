"""The FTP password is e-mailed only to an address the site configured, never to one
from the calendar (whoever wrote the booking); the session always shows it to its login.

Real SMTP (aiosmtpd) for the notices; a real session on Docker, reached with
paramiko, and a real host account for where the password is kept.
"""

from __future__ import annotations

import os
import stat
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import DockerHarness, SMTPServer
from test_runtime import Site, host_login, make_site, run, ssh_login

from gpuresa.config.reading import parse_config
from gpuresa.daemon.notices import Notices
from gpuresa.journal.guard import open_journal
from gpuresa.mail.notices import FTP_PASSWORD_PATH
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Session
from gpuresa.sessions.files import FTP_PASSWORD_FILE
from gpuresa.sessions.labels import SESSION_FILES_TARGET

__all__ = ["host_login"]  # a fixture of test_runtime.py, used here too

PASSWORD = "Ftp-Secret-4711"
FORGED_ORGANIZER = "mallory@evil.example"


def session(user: str = "alice") -> Session:
    now = datetime.now(UTC)
    return Session(
        key="booking-1", user=user, host="gpu1", template="pytorch", cuda=None,
        gpu_count=1, gpu_indices=(0,),
        start=now, end=now + timedelta(hours=2), ssh_port=20001, ftp_port=21001,
        ftp_passive_first=22000, ftp_passive_last=22009, state="running",
        output_dir=Path("/srv/out"), ftp_user="alice-ftp", ftp_password=PASSWORD,
        email=FORGED_ORGANIZER,
    )  # fmt: skip


def start_notice(tmp_path: Path, smtp_server: SMTPServer, users: dict[str, Any]) -> Any:
    """Send the start notice of `session()` through the outbox; the message that arrived."""
    config = parse_config(
        {
            "daemon": {"host": "gpu1", "state_dir": str(tmp_path / "state")},
            "calendars": [{"name": "lab", "kind": "ics", "url": str(tmp_path)}],
            "hosts": [{"name": "gpu1", "gpus": [0]}],
            "users": users,
            "notify": {"enabled": True, "smtp_host": "127.0.0.1", "smtp_port": smtp_server.port},
        }
    )
    journal, _ = open_journal(tmp_path / "state" / "journal.sqlite")
    outbox = Outbox(journal, Notifier(config.notify, config.users))
    outbox.start()
    try:
        # the booking's own address, as the calendar gave it: the ORGANIZER
        assert Notices(config, Notifier(config.notify, config.users), outbox).start(
            session(), FORGED_ORGANIZER
        )
        return smtp_server.wait_for(1)[0]
    finally:
        outbox.stop()
        journal.close()


def recipients(smtp_server: SMTPServer) -> list[str]:
    return [address for _, addresses in smtp_server.envelopes for address in addresses]


def test_an_organizer_from_the_calendar_never_receives_the_ftp_password(
    tmp_path: Path, smtp_server: SMTPServer
) -> None:
    message = start_notice(tmp_path, smtp_server, {})
    body = message.get_content()
    assert recipients(smtp_server) == [FORGED_ORGANIZER]
    assert PASSWORD not in message.as_string()
    # the rest of the notice is there, and says where the password is
    assert "ssh -p 20001 alice@gpu1" in body
    assert f"cat {FTP_PASSWORD_PATH}" in body


@pytest.mark.parametrize(
    ("users", "address"),
    [
        ({"emails": {"alice": "alice@lab.example"}}, "alice@lab.example"),
        ({"email_domain": "lab.example"}, "alice@lab.example"),
        # an unusable entry falls back to the domain, never to the calendar
        (
            {"emails": {"alice": "not an address"}, "email_domain": "lab.example"},
            "alice@lab.example",
        ),
    ],
)
def test_an_address_the_site_configured_receives_the_ftp_password(
    tmp_path: Path, smtp_server: SMTPServer, users: dict[str, Any], address: str
) -> None:
    message = start_notice(tmp_path, smtp_server, users)
    assert recipients(smtp_server) == [address]
    assert f"FTP password:  {PASSWORD}" in message.get_content()


def test_the_password_path_is_where_the_session_files_are_mounted() -> None:
    assert str(FTP_PASSWORD_PATH) == str(SESSION_FILES_TARGET / FTP_PASSWORD_FILE)


@pytest.fixture
def docker_site(tmp_path: Path, docker_harness: DockerHarness) -> Site:
    site = make_site(tmp_path, docker_harness.client)
    site.runtime().ensure_image("pytorch", None)
    site.runtime().ensure_ftp_image()
    return site


def test_the_session_shows_its_login_the_ftp_password_and_no_one_else(
    docker_site: Site, host_login: str
) -> None:
    runtime = docker_site.runtime()
    running = runtime.start(docker_site.spec(runtime))
    with ssh_login(running, "alice", docker_site.key("alice")) as client:
        assert run(client, f"cat {FTP_PASSWORD_PATH}") == (0, running.ftp_password + "\n")
        code, motd = run(client, "cat /etc/motd")
        assert code == 0 and f"cat {FTP_PASSWORD_PATH}" in motd
        # the file cannot be changed from inside, not even by root
        code, _ = run(client, f"sudo -n sh -c 'echo x > {FTP_PASSWORD_PATH}'")
        assert code != 0
    # on the host: the login's mapped uid alone may read it; a host account may not
    on_host = runtime.files.path(running.key) / FTP_PASSWORD_FILE
    details = on_host.stat()
    assert stat.S_IMODE(details.st_mode) == 0o400
    assert details.st_uid != 0 and details.st_uid != os.geteuid()
    refused = subprocess.run(
        ["runuser", "-u", host_login, "--", "cat", str(on_host)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode != 0 and running.ftp_password not in refused.stdout
    assert "Permission denied" in refused.stderr
