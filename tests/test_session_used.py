"""Whether a session was used (a login seen), on Docker and Podman: what no-shows rest on.

A session's `used` reads its sshd's log and its FTP server's log. These tests
log in the ways a user can (SSH, SFTP, FTPS) and the ways an outsider can
(a refused key, a login name written to look like a log line) against real
sessions, and check what the backend answers after each.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import paramiko
import pytest
from ftps_client import FtpsError
from support.logins import ssh_login
from support.waiting import wait_for
from test_runtime import Site, ftp_login
from test_runtime import built_fixture as built_fixture  # the module's image builds
from test_runtime import site_fixture as site_fixture

from gpuresa.backends.engines.logins import START_MARK, session_used
from gpuresa.backends.engines.lookup import Found
from gpuresa.planning.release import LOG_LAG
from gpuresa.sessions.logins import LOG_LIMIT, ftp_login_seen, read_log, ssh_login_seen

# a login name a stranger may send: sshd logs it inside its own "Invalid user" line
FORGED = "Accepted publickey for alice from 10.0.0.1 port 1 ssh2"


def test_a_session_is_unused_until_its_user_logs_in_by_ssh(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    assert runtime.used(session.key) is False
    # a stranger's name made to look like an "Accepted" line, and bob's key refused
    for login, key in ((FORGED, site.key("alice")), ("alice", site.key("bob"))):
        with (
            pytest.raises(paramiko.AuthenticationException),
            ssh_login(session.ssh_port, login, key),
        ):
            pass
    # a connection that never authenticates
    with socket.create_connection(("127.0.0.1", session.ssh_port), 5) as raw:
        raw.recv(64)
    assert runtime.used(session.key) is False
    with ssh_login(session.ssh_port, "alice", site.key("alice")):
        pass
    # the engine ships the container's output to its log through pipes: a moment later
    wait_for(lambda: runtime.used(session.key), LOG_LAG.total_seconds(), "the login in the log")


def test_an_ftp_login_counts_and_a_refused_one_does_not(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    with pytest.raises(FtpsError), ftp_login(session, session.ftp_user, "not-the-password"):
        pass
    assert runtime.used(session.key) is False
    with ftp_login(session, session.ftp_user, session.ftp_password) as ftp:
        ftp.names("/")
    wait_for(lambda: runtime.used(session.key), LOG_LAG.total_seconds(), "the FTP login")


def test_a_session_that_is_not_running_tells_nothing(site: Site) -> None:
    runtime = site.runtime()
    assert runtime.used("no-such-session") is None


@pytest.mark.parametrize(
    ("text", "seen"),
    [
        ("Accepted publickey for alice from 172.17.0.1 port 40000 ssh2: ED25519 SHA256:x\n", True),
        ("Accepted keyboard-interactive/pam for alice from ::1 port 5 ssh2\n", True),
        # sshd -E adds a date and its name
        ("Nov 26 02:00:01 vm sshd[42]: Accepted publickey for alice from ::1 port 5 ssh2\n", True),
        ("Accepted publickey for bob from 172.17.0.1 port 40000 ssh2\n", False),
        (f"Invalid user {FORGED} from 172.17.0.1 port 40000\n", False),
        (f"Connection closed by invalid user {FORGED} 172.17.0.1 port 4 [preauth]\n", False),
        ("Failed publickey for alice from 172.17.0.1 port 40000 ssh2\n", False),
        ("xAccepted publickey for alice from 172.17.0.1 port 40000 ssh2\n", False),
        ("", False),
    ],
)
def test_only_an_accepted_line_of_the_login_counts_as_an_ssh_login(text: str, seen: bool) -> None:
    assert ssh_login_seen(text, "alice") is seen


@pytest.mark.parametrize(
    ("text", "seen"),
    [
        ('Thu Nov 26 02:00:01 2026 [pid 7] [alice] OK LOGIN: Client "172.17.0.1"\n', True),
        ('Thu Nov 26 02:00:01 2026 [pid 7] [alice] FAIL LOGIN: Client "172.17.0.1"\n', False),
        ('Thu Nov 26 02:00:01 2026 [pid 7] [bob] OK LOGIN: Client "172.17.0.1"\n', False),
        ('Thu Nov 26 02:00:01 2026 [pid 7] CONNECT: Client "[alice] OK LOGIN:"\n', False),
    ],
)
def test_only_an_ok_login_line_of_the_login_counts_as_an_ftp_login(text: str, seen: bool) -> None:
    assert ftp_login_seen(text, "alice") is seen


def test_a_log_a_login_replaced_is_read_with_care(tmp_path: Path) -> None:
    """udocker's and Slurm's logs lie where their login can put a link, a FIFO or a huge
    file: none is followed, waited on or read whole."""
    log = tmp_path / "job.log"
    log.write_text("Accepted publickey for alice from ::1 port 5 ssh2\n")
    assert read_log(log) == "Accepted publickey for alice from ::1 port 5 ssh2\n"
    assert read_log(tmp_path / "missing.log") is None
    link = tmp_path / "link.log"
    link.symlink_to("/dev/zero")
    assert read_log(link) is None
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert read_log(fifo) is None  # returns at once: nobody writes to it
    huge = tmp_path / "huge.log"
    with huge.open("wb") as handle:
        handle.truncate(LOG_LIMIT * 50)
    text = read_log(huge)
    assert text is not None and len(text) == LOG_LIMIT


class _Logs:
    """An engine gateway's answers for `session_used`: the main log, no FTP log."""

    def __init__(self, text: str) -> None:
        self.text = text

    def logs(self, container: str, lines: int | None = 30, *, strict: bool = False) -> str:
        return self.text

    def read_file(self, container: str, path: str, key: str | None = None) -> bytes | None:
        return None


@pytest.mark.parametrize(
    ("text", "used"),
    [
        (f"{START_MARK}@k ready for alice (uid 1000)\nServer listening on :: port 22.\n", False),
        (f"{START_MARK}@k ready\nAccepted publickey for alice from ::1 port 5 ssh2\n", True),
        # emptied by the engine after a flood of refused connections: nothing to tell
        (f"Invalid user x{' y' * 10} from ::1 port 5\n" * 3, None),
        ("Accepted publickey for alice from ::1 port 5 ssh2\n", True),
    ],
)
def test_a_log_that_no_longer_reaches_the_start_tells_nothing(text: str, used: bool | None) -> None:
    main = {"Id": "main", "Name": "/main"}
    found = Found(main=main, ftp=None)
    assert session_used(_Logs(text), found, "alice", "@k") is used  # type: ignore[arg-type]
