"""End to end, a hostile calendar writer: real Radicale, real Docker, the daemon as a process.

An ended booking moved over the present does not run again under its key, and
a UID copied into another calendar (listed first) takes nothing from the
running session it copies: the copy is refused with its reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

from conftest import DockerHarness, RadicaleServer
from support.waiting import polls_later, wait_for
from test_daemon_e2e import Stack, next_second, stack

from gpuresa.journal.store import Journal

__all__ = ["stack"]  # the fixture, used by name


def rejected(stack: Stack) -> list[dict[str, str]]:
    """The rejections `gpuresa status --json` shows."""
    command = [sys.executable, "-m", "gpuresa.cli", "--config", str(stack.config_file)]
    shown = subprocess.run([*command, "status", "--json"], capture_output=True, check=True)
    found: list[dict[str, str]] = json.loads(shown.stdout)["rejected"]
    return found


def moved_keys(stack: Stack) -> list[str]:
    journal = Journal(stack.config.daemon.state_dir / "journal.sqlite", read_only=True)
    try:
        return [
            row.key for row in journal.reservations.all() if row.key.startswith("ended-1/moved-")
        ]
    finally:
        journal.close()


def state(stack: Stack, key: str) -> str | None:
    journal = Journal(stack.config.daemon.state_dir / "journal.sqlite", read_only=True)
    try:
        return journal.states.get(key)
    finally:
        journal.close()


def test_a_moved_ended_booking_and_a_copied_uid_take_nothing(
    stack: Stack, radicale_private: RadicaleServer, docker_harness: DockerHarness
) -> None:
    # a second calendar, listed before the first: with no history it would win a copy
    copies = radicale_private.new_calendar("copies")
    text = stack.config_file.read_text()
    first = text.index("[[calendars]]")
    block = (
        f'[[calendars]]\nname = "copies"\nkind = "caldav"\nurl = "{copies.url}"\n'
        f'username = "{radicale_private.username}"\n'
        f'password_file = "{radicale_private.password_file}"\n'
        f'host = "{stack.config.daemon.host}"\ndefault_template = "pytorch"\n\n'
    )
    stack.config_file.write_text(text[:first] + block + text[first:])
    start = next_second(10)
    victim = stack.book("victim-1", start, start + timedelta(minutes=10), "alice", "gpus: 1")
    ended = stack.book("ended-1", start, start + timedelta(seconds=15), "alice", "gpus: 1")
    stack.start_daemon()

    session = wait_for(
        lambda: next(
            (
                item
                for item in stack.sessions()
                if item.key == "victim-1" and item.state == "running"
            ),
            None,
        ),
        60,
        "alice's session to run",
    )
    wait_for(lambda: state(stack, "ended-1") == "ended", 60, "the short booking to end")
    ids = {docker_harness.client.containers.get(name).id for name in session.containers}

    # the ended booking moved over the present, and the running booking's UID copied
    component = ended.icalendar_component
    component["DTEND"].dt = datetime.now(UTC) + timedelta(minutes=10)
    ended.save()
    copies.save_event(
        dtstart=start, dtend=start + timedelta(hours=5), summary="mallory",
        description="gpus: 1", uid="victim-1",
    )  # fmt: skip
    refused = wait_for(
        lambda: next(
            (item for item in rejected(stack) if item["key"].startswith("victim-1/")), None
        ),
        30,
        "the copy's rejection in gpuresa status",
    )
    assert refused["key"] == "victim-1/copy/copies/victim-1"
    assert refused["user"] == "mallory"
    assert "already a booking in calendar gpu" in refused["reason"]
    wait_for(lambda: moved_keys(stack), 30, "the moved booking under a key of its own")
    # three polls later: alice's session is the same one, the ended key never came back
    polls_later(stack.config, 3)
    still = stack.session("victim-1")
    assert still is not None and still.user == "alice" and still.state == "running"
    assert {docker_harness.client.containers.get(name).id for name in still.containers} == ids
    assert stack.session("ended-1") is None
    assert state(stack, "ended-1") == "ended"
    assert state(stack, "victim-1") in ("running", "warned")
    del victim
