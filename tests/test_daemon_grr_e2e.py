"""End to end with GRR: a row of GRR's database becomes an SSH login, its deletion an end.

The daemon runs as its own process on real Docker and reads a real MariaDB
with GRR's tables through a read-only account.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import TEST_HOST, DockerHarness, RadicaleServer, SMTPServer
from grr_database import SOCKET, GRRDatabase
from support.waiting import wait_for
from test_daemon_e2e import Stack, mail_matching, make_stack, next_second

from gpuresa.config.reading import load_config
from gpuresa.journal.store import Journal


@pytest.fixture
def grr_stack(
    tmp_path: Path,
    radicale_private: RadicaleServer,
    smtp_server: SMTPServer,
    docker_harness: DockerHarness,
    request: pytest.FixtureRequest,
    grr_database: GRRDatabase,
) -> Iterator[tuple[Stack, GRRDatabase, int]]:
    """The end-to-end stack with its calendar replaced by a GRR database's room."""
    stacks = make_stack(tmp_path, radicale_private, smtp_server, docker_harness, request)
    stack = next(stacks)
    area = grr_database.add_area("Serveurs GPU")
    room = grr_database.add_room("GPU test", area)
    grr_database.add_user("alice", "alice@example.org")
    text = stack.config_file.read_text()
    first, last = text.index("[[calendars]]"), text.index("[[hosts]]")
    calendar = f"""[[calendars]]
name = "grr"
kind = "grr"
url = "mysql://localhost/{grr_database.name}"
unix_socket = "{SOCKET}"
username = "{grr_database.reader}"
password_file = "{grr_database.password_file}"
rooms = {{ "GPU test" = "{TEST_HOST}" }}
default_template = "pytorch"

"""
    stack.config_file.write_text(text[:first] + calendar + text[last:])
    stack.config = load_config(stack.config_file)
    yield stack, grr_database, room
    with contextlib.suppress(StopIteration):
        next(stacks)


def test_a_grr_row_becomes_a_session_and_its_deletion_ends_it(
    grr_stack: tuple[Stack, GRRDatabase, int],
) -> None:
    stack, database, room = grr_stack
    start = next_second(6)
    entry = database.book(room, start, start + timedelta(minutes=10), "alice", "gpus: 1")
    key = f"grr:grr_:{entry}"
    stack.start_daemon()

    session = wait_for(lambda: stack.session(key), 30, "the session to run")
    assert (session.user, session.start) == ("alice", start)
    assert datetime.now(UTC) >= start - stack.config.daemon.prepare_ahead
    client = wait_for(lambda: stack.login(session.ssh_port), 20, "an SSH login")
    client.close()

    database.delete(entry)  # GRR deletes softly
    deleted = datetime.now(UTC)
    mail_matching(stack.smtp, "cancel")
    grace = stack.config.daemon.cancel_grace
    poll = stack.config.daemon.poll_interval
    gone = wait_for(
        lambda: None if stack.session(key) else datetime.now(UTC),
        (grace + poll).total_seconds() + 20,
        "the cancelled session to stop",
    )
    assert gone - deleted >= grace
    assert gone - deleted <= grace + poll + timedelta(seconds=4)

    stack.kill_daemon(signal.SIGTERM)
    journal = Journal(stack.config.daemon.state_dir / "journal.sqlite", read_only=True)
    with contextlib.closing(journal):
        assert journal.states.get(key) == "cancelled"
