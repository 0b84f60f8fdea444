"""The real services the suite relies on work as the other tests expect."""

from __future__ import annotations

import smtplib
from datetime import UTC, datetime, timedelta
from email.message import EmailMessage
from typing import Any

from conftest import DockerHarness, RadicaleServer, SMTPServer


def test_radicale_stores_and_returns_an_event(radicale: RadicaleServer) -> None:
    calendar = radicale.new_calendar()
    start = datetime(2026, 12, 1, 9, tzinfo=UTC)
    calendar.save_event(
        dtstart=start, dtend=start + timedelta(hours=2), summary="alice", uid="fixture-event-1"
    )
    events = calendar.events()
    assert len(events) == 1
    component = events[0].icalendar_component
    assert str(component["UID"]) == "fixture-event-1"
    assert str(component["SUMMARY"]) == "alice"
    assert component.decoded("DTSTART") == start


def test_radicale_refuses_a_wrong_password(radicale: RadicaleServer) -> None:
    import pytest
    from caldav.davclient import DAVClient
    from caldav.lib.error import AuthorizationError

    client: Any = DAVClient(url=radicale.url, username=radicale.username, password="wrong")
    with pytest.raises(AuthorizationError):
        client.principal()


def test_container_runs_in_a_user_namespace(docker_harness: DockerHarness) -> None:
    container = docker_harness.run(command=["sleep", "60"])
    exit_code, output = container.exec_run(["cat", "/proc/self/uid_map"])
    assert exit_code == 0
    inside, outside, length = (int(part) for part in output.split())
    # root in the container maps to an unprivileged uid range on the host
    assert inside == 0
    assert outside != 0
    assert length <= 65536
    exit_code, output = container.exec_run(["id", "-u"])
    assert output.strip() == b"0"


def test_smtp_fixture_receives_a_message(smtp_server: SMTPServer) -> None:
    message = EmailMessage()
    message["From"] = "gpuresa@localhost"
    message["To"] = "alice@example.org"
    message["Subject"] = "fixture check"
    message.set_content("hello")
    with smtplib.SMTP(smtp_server.host, smtp_server.port, timeout=10) as smtp:
        smtp.send_message(message)
    received = smtp_server.wait_for(1)
    assert received[0]["Subject"] == "fixture check"
    assert received[0].get_content().strip() == "hello"
    assert smtp_server.envelopes[0] == ("gpuresa@localhost", ["alice@example.org"])
