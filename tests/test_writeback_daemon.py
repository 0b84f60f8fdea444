"""The daemon writes each booking's state into its own event, on real Radicale and Docker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import icalendar
import pytest
from conftest import DockerHarness, RadicaleServer, SMTPServer
from support.waiting import wait_for
from test_daemon_e2e import Stack, make_stack, next_second

from gpuresa.config.reading import load_config
from gpuresa.ical.state_block import BLOCK_START, STATE_PROPERTY, strip_block


@pytest.fixture
def stack(
    tmp_path: Path,
    radicale_private: RadicaleServer,
    smtp_server: SMTPServer,
    docker_harness: DockerHarness,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    made = make_stack(tmp_path, radicale_private, smtp_server, docker_harness, request)
    stack = next(made)
    text = stack.config_file.read_text()
    stack.config_file.write_text(
        text.replace('default_template = "pytorch"\n', 'default_template = "pytorch"\n'
                     'write_back = "event"\n', 1)
    )  # fmt: skip
    stack.config = load_config(stack.config_file)
    assert stack.config.calendars[0].write_back == "event"
    yield stack
    for _ in made:  # the stack's own teardown
        pass


def shown(event: object) -> tuple[str, str]:
    """(X-GPURESA-STATE, DESCRIPTION) of a caldav event, as a calendar app reads them."""
    event.load()  # type: ignore[attr-defined]
    component = icalendar.Calendar.from_ical(event.data).walk("VEVENT")[0]  # type: ignore[attr-defined]
    return str(component.get(STATE_PROPERTY, "")), str(component.get("DESCRIPTION", ""))


def written(event: object, state: str) -> str | None:
    """The event's DESCRIPTION once gpuresa wrote `state` into it, else None."""
    found, text = shown(event)
    return text if found == state else None


def test_the_daemon_writes_running_ended_and_refused_into_the_bookings_events(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    start = next_second(12)
    end = start + timedelta(seconds=25)
    description = "template: pytorch\ngpus: 1\nmy own notes"
    event = stack.book("written-1", start, end, "alice", description)
    refused = stack.book("written-2", start, end, "alice", "template: no-such-template\ngpus: 1")
    stack.start_daemon()

    text = wait_for(lambda: written(refused, "refused"), 30, "the refusal written")
    assert "no-such-template" in text
    session = wait_for(lambda: stack.session("written-1"), 20, "the prepared session")
    text = wait_for(
        lambda: written(event, "running"),
        (start - next_second(0)).total_seconds() + 30,
        "the running state written",
    )
    assert f"ssh -p {session.ssh_port} alice@127.0.0.1" in text
    assert "@cert-authority" in text
    assert strip_block(text) == description
    # gpuresa's own write is no change of the booking: the session is the same one
    now_running = stack.session("written-1")
    assert now_running is not None and session.containers[0] in now_running.containers
    text = wait_for(
        lambda: written(event, "ended"),
        (end - next_second(0)).total_seconds() + 40,
        "the end written",
    )
    assert "The output is kept in" in text and text.count(BLOCK_START) == 1
    assert strip_block(text) == description
    # the admin sees how write-back stands in `gpuresa status`
    from gpuresa.cli import main

    assert main(["status", "--config", str(stack.config_file), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    name = stack.config.calendars[0].name
    assert status["write_back"] == {name: "on"}
