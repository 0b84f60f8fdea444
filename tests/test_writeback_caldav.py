"""Calendar write-back against a real Radicale: states appear, the booking stays, edits win.

Events are read back with the `caldav` client and parsed with `icalendar`,
as a calendar app would; the booking reader is the daemon's own
(`CalDAVSource`), so a write that it counted as a change of the booking
would show here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import icalendar
import pytest
from conftest import RadicaleServer, start_radicale
from support.waiting import wait_for

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.ical.state_block import BLOCK_START, OWN_PROPERTIES, STATE_PROPERTY, strip_block
from gpuresa.journal.guard import open_journal
from gpuresa.journal.store import Journal
from gpuresa.journal.writeback import WriteBackRow
from gpuresa.model import Rejection, Reservation, Session, SessionSpec
from gpuresa.reservations.sources.caldav import CalDAVSource
from gpuresa.reservations.sources.caldav_write import (
    Account,
    CalDAVWriter,
    ObjectRefused,
    WriteConflict,
    WriteFailed,
    WriteRefused,
)
from gpuresa.writeback.mirror import mirror_uid
from gpuresa.writeback.notes import CalendarNotes
from gpuresa.writeback.standing import OFF_FACT, write_back_status
from gpuresa.writeback.worker import WriteBackWorker

START = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
END = START + timedelta(hours=2)
USER_DESCRIPTION = "template: pytorch\ngpus: 1\nmy experiment, with a comma; and more"


def make_config(
    tmp_path: Path, url: str, server: RadicaleServer, mode: str = "event", **calendar: Any
) -> Config:
    return parse_config(
        {
            "daemon": {"host": "gpu1", "state_dir": str(tmp_path / "state")},
            "calendars": [
                {
                    "name": "gpu1",
                    "url": url,
                    "username": server.username,
                    "password_file": str(server.password_file),
                    "host": "gpu1",
                    "write_back": mode,
                    "write_timeout": "2s",
                    **calendar,
                }
            ],
            "hosts": [{"name": "gpu1", "gpus": [0, 1], "public_name": "gpu1.example.org"}],
        }
    )


def booking_text(uid: str, description: str = USER_DESCRIPTION) -> str:
    event = icalendar.Event()
    event.add("uid", uid)
    event.add("dtstamp", START - timedelta(days=1))
    event.add("dtstart", START)
    event.add("dtend", END)
    event.add("summary", "alice")
    event.add("organizer", "mailto:alice@example.org")
    event.add("description", description)
    calendar = icalendar.Calendar()
    calendar.add("prodid", "-//test//EN")
    calendar.add("version", "2.0")
    calendar.add_component(event)
    return str(calendar.to_ical().decode())


@dataclass
class Booked:
    """A booking saved in Radicale, recorded in the journal as the daemon would."""

    reservation: Reservation
    event: Any  # the caldav Event

    def stored(self) -> str:
        self.event.load()
        return str(self.event.data)


def book(calendar: Any, journal: Journal, uid: str | None = None) -> Booked:
    uid = uid or f"booking-{uuid.uuid4().hex[:8]}"
    event = calendar.save_event(booking_text(uid))
    reservation = Reservation(
        key=uid,
        uid=uid,
        recurrence_id=None,
        calendar="gpu1",
        host="gpu1",
        user="alice",
        template="pytorch",
        cuda=None,
        gpus=1,
        start=START,
        end=END,
        href=unquote(urlsplit(str(event.url)).path),
    )
    journal.reservations.record([reservation], [], datetime.now(UTC))
    return Booked(reservation, event)


def session_of(reservation: Reservation, tmp_path: Path) -> Session:
    spec = SessionSpec(
        key=reservation.key,
        user="alice",
        host="gpu1",
        template="pytorch",
        cuda=None,
        gpu_count=1,
        gpu_indices=(0,),
        start=reservation.start,
        end=reservation.end,
        ssh_port=2201,
        ftp_port=2301,
        ftp_passive_first=2400,
        ftp_passive_last=2404,
    )
    return Session.of(spec, state="running", output_dir=tmp_path / "outputs" / "alice" / "x")


def not_ours(text: str) -> list[str]:
    """The event's content lines (unfolded) that are neither DESCRIPTION nor gpuresa's."""
    unfolded = text.replace("\r\n", "\n").replace("\n ", "").replace("\n\t", "")
    return [
        line
        for line in unfolded.splitlines()
        if line.split(":", 1)[0].split(";", 1)[0].upper() not in {"DESCRIPTION", *OWN_PROPERTIES}
    ]


def shown(text: str) -> tuple[str, str]:
    """(X-GPURESA-STATE, DESCRIPTION) as a calendar app reads them."""
    event = icalendar.Calendar.from_ical(text).walk("VEVENT")[0]
    return str(event.get(STATE_PROPERTY, "")), str(event.get("DESCRIPTION", ""))


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened, _ = open_journal(tmp_path / "journal.sqlite")
    yield opened
    opened.close()


def test_every_state_appears_and_the_booking_itself_never_changes(
    tmp_path: Path, radicale: RadicaleServer, journal: Journal
) -> None:
    calendar = radicale.new_calendar()
    config = make_config(tmp_path, str(calendar.url), radicale)
    worker = WriteBackWorker(config, journal)
    notes = CalendarNotes(config, journal, worker)
    booked = book(calendar, journal)
    reservation = booked.reservation
    original = booked.stored()
    source = CalDAVSource(config.calendars[0], tmp_path / "state")
    source.poll()
    session = session_of(reservation, tmp_path)
    ended_at = END - timedelta(minutes=30)
    steps: list[tuple[Any, str, list[str]]] = [
        (
            lambda: notes.refused(
                Rejection(reservation.key, reservation.uid, "gpu1", "unknown template 'tf9'")
            ),
            "refused",
            ["Refused: unknown template 'tf9'"],
        ),
        (lambda: notes.prepared(session), "prepared", ["Prepared on gpu1.example.org"]),
        (
            lambda: notes.running(session, "gpu1.example.org"),
            "running",
            ["ssh -p 2201 alice@gpu1.example.org", "@cert-authority [gpu1.example.org", "/output"],
        ),
        (
            lambda: notes.ended(session, ended_at),
            "ended",
            [str(session.output_dir), "kept", "sftp -P"],
        ),
        (lambda: notes.ended(session, ended_at, "released"), "released", ["nobody logged in"]),
        (
            lambda: notes.ended(session, ended_at, "preempted"),
            "preempted",
            ["its GPUs went to a firm booking"],
        ),
    ]
    for note, state, words in steps:
        note()
        worker.run_once()
        stored = booked.stored()
        found_state, description = shown(stored)
        assert found_state == state
        for word in words:
            assert word in description, (state, word, description)
        assert description.count(BLOCK_START) == 1
        # the booking: every other line as it was, the user's text as it was
        assert not_ours(stored) == not_ours(original)
        assert strip_block(description) == USER_DESCRIPTION
        # the daemon's reader: gpuresa's own write is no change of the booking
        result = source.poll()
        assert not result.changed, state
        assert source.snapshot()[reservation.href].decode().count(BLOCK_START) == 1


def test_a_users_edit_racing_the_write_wins(
    tmp_path: Path, radicale: RadicaleServer, journal: Journal
) -> None:
    calendar = radicale.new_calendar()
    config = make_config(tmp_path, str(calendar.url), radicale)
    booked = book(calendar, journal)
    edits: list[str] = []

    class RacedWriter(CalDAVWriter):
        """Between gpuresa's read and its write, the user edits the event."""

        def put(self, href: str, data: str, etag: str | None) -> str | None:
            if not edits:
                event = calendar.event_by_uid(booked.reservation.uid)
                component = event.icalendar_component
                component["DESCRIPTION"] = "template: pytorch\ngpus: 2\nedited by alice"
                component["SUMMARY"] = "alice"
                event.save()
                edits.append("edited")
            return super().put(href, data, etag)

    worker = WriteBackWorker(config, journal, writer_factory=RacedWriter)
    notes = CalendarNotes(config, journal, worker)
    notes.prepared(session_of(booked.reservation, tmp_path))
    worker.run_once()
    assert edits == ["edited"]
    state, description = shown(booked.stored())
    assert state == "prepared"
    # the user's edit is there, whole; gpuresa's block was made again on top of it
    assert strip_block(description) == "template: pytorch\ngpus: 2\nedited by alice"
    assert journal.writeback.get(booked.reservation.key).written_at is not None  # type: ignore[union-attr]


def test_a_refused_booking_never_recorded_is_found_by_its_uid(
    tmp_path: Path, radicale: RadicaleServer, journal: Journal
) -> None:
    calendar = radicale.new_calendar()
    config = make_config(tmp_path, str(calendar.url), radicale)
    uid = f"refused-{uuid.uuid4().hex[:8]}"
    event = calendar.save_event(booking_text(uid, "gpus: 99"))
    worker = WriteBackWorker(config, journal)
    CalendarNotes(config, journal, worker).refused(
        Rejection(uid, uid, "gpu1", "99 GPUs asked, gpu1 has 2", user="alice", start=START, end=END)
    )
    worker.run_once()
    event.load()
    state, description = shown(str(event.data))
    assert state == "refused" and "99 GPUs asked" in description


class SilentServer:
    """A TCP server that accepts connections and never answers: a hung CalDAV server."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.port = self.socket.getsockname()[1]
        self.held: list[socket.socket] = []
        self.closing = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.held.append(connection)

    def close(self) -> None:
        self.closing = True
        self.socket.close()
        for connection in self.held:
            connection.close()


def test_a_hanging_server_delays_nothing_and_the_write_is_retried(
    tmp_path: Path, radicale: RadicaleServer, journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    silent = SilentServer()
    try:
        config = make_config(tmp_path, f"http://127.0.0.1:{silent.port}/gpuresa/cal/", radicale)
        worker = WriteBackWorker(config, journal)
        worker.start()
        notes = CalendarNotes(config, journal, worker)
        reservations = []
        for index in range(20):
            reservation = Reservation(
                key=f"hung-{index}", uid=f"hung-{index}", recurrence_id=None, calendar="gpu1",
                host="gpu1", user="alice", template="pytorch", cuda=None, gpus=1,
                start=START, end=END, href=f"/gpuresa/cal/hung-{index}.ics",
            )  # fmt: skip
            reservations.append(reservation)
        journal.reservations.record(reservations, [], datetime.now(UTC))
        # what the daemon's start path calls: a journal write each, whatever the server does
        began = time.perf_counter()
        for reservation in reservations:
            notes.prepared(session_of(reservation, tmp_path))
        elapsed = time.perf_counter() - began
        assert elapsed < 1.0, f"20 notes took {elapsed:.2f} s"

        # the worker waits for the server (within write_timeout), fails, and will try again
        def failed() -> WriteBackRow | None:
            found = journal.writeback.get("hung-0")
            return found if found is not None and found.last_error else None

        row = wait_for(failed, 30, "the first write to fail")
        assert row.written_at is None and row.next_try > datetime.now(UTC)
        assert "no answer" in (row.last_error or "")
        worker.stop(timeout=5)
    finally:
        silent.close()


def rights_radicale(directory: Path) -> RadicaleServer:
    """Radicale where "gpuresa" may only read the calendars of "owner"."""
    server = start_radicale(directory)
    assert server.config_file is not None
    users = directory / "users"
    users.write_text(users.read_text() + "owner:owner-password\n")
    rights = directory / "rights"
    rights.write_text(
        """
[root]
user: .+
collection:
permissions: R
[principal]
user: .+
collection: {user}
permissions: RW
[owner]
user: owner
collection: owner/[^/]+
permissions: rw
[reader]
user: gpuresa
collection: owner/[^/]+
permissions: r
"""
    )
    server.config_file.write_text(
        server.config_file.read_text() + f"[rights]\ntype = from_file\nfile = {rights}\n"
    )
    server.start()
    return server


# starts a Radicale of its own (with a rights file): a service all the same
@pytest.mark.services
def test_a_refused_write_is_reported_once_and_off_until_the_config_changes(
    tmp_path: Path, journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    from caldav.davclient import DAVClient

    server = rights_radicale(tmp_path / "radicale")
    try:
        owner: Any = DAVClient(url=server.url, username="owner", password="owner-password")
        calendar = owner.principal().make_calendar(name="shared", cal_id="shared")
        config = make_config(tmp_path, f"{server.url}owner/shared/", server)
        first = book(calendar, journal)
        second = book(calendar, journal)
        worker = WriteBackWorker(config, journal)
        notes = CalendarNotes(config, journal, worker)
        caplog.set_level(logging.ERROR, logger="gpuresa.writeback.worker")
        notes.prepared(session_of(first.reservation, tmp_path))
        worker.run_once()
        notes.prepared(session_of(second.reservation, tmp_path))
        worker.run_once()
        errors = [record for record in caplog.records if "write-back is off" in record.message]
        assert len(errors) == 1 and "may not write" in errors[0].message
        assert journal.facts.get(OFF_FACT + "gpu1") is not None
        assert write_back_status(journal, config)["gpu1"].startswith("off: ")
        assert BLOCK_START not in first.stored() and BLOCK_START not in second.stored()
        # nothing more is queued for that calendar while its config is the same
        assert journal.writeback.get(second.reservation.key) is None
        # a new configuration (say, after the admin granted the rights) turns it on again
        changed = make_config(tmp_path, f"{server.url}owner/shared/", server, write_timeout="3s")
        assert journal.writeback.get(first.reservation.key) is not None
        notes = CalendarNotes(changed, journal, worker)
        notes.prepared(session_of(second.reservation, tmp_path))
        worker.set_config(changed)
        worker.run_once()  # still read-only: refused, and off again under this config
        assert journal.writeback.get(second.reservation.key) is not None
    finally:
        server.stop()


def test_the_mirror_holds_one_event_per_booking_and_follows_cancellations(
    tmp_path: Path, radicale: RadicaleServer, journal: Journal
) -> None:
    calendar = radicale.new_calendar()
    mirror_url = f"{radicale.url}{radicale.username}/mirror-{uuid.uuid4().hex[:8]}/"
    config = make_config(tmp_path, str(calendar.url), radicale, "mirror", mirror_url=mirror_url)
    worker = WriteBackWorker(config, journal)
    notes = CalendarNotes(config, journal, worker)
    bookings = [book(calendar, journal) for _ in range(3)]
    reservations = [booked.reservation for booked in bookings]
    notes.seen(reservations, set(), {"gpu1"})
    worker.run_once()  # the mirror is made (MKCALENDAR), then written
    mirror = radicale.client().calendar(url=mirror_url)

    def mirrored() -> dict[str, Any]:
        events = {}
        for event in mirror.events():
            component = icalendar.Calendar.from_ical(event.data).walk("VEVENT")[0]
            events[str(component["UID"])] = component
        return events

    events = mirrored()
    assert set(events) == {mirror_uid(reservation.key) for reservation in reservations}
    for reservation in reservations:
        event = events[mirror_uid(reservation.key)]
        assert event.decoded("DTSTART") == START and event.decoded("DTEND") == END
        assert str(event[STATE_PROPERTY]) == "booked"
    # the first one runs; the second is cancelled (gone from the calendar)
    notes.running(session_of(reservations[0], tmp_path), "gpu1.example.org")
    notes.seen([reservations[0], reservations[2]], set(), {"gpu1"})
    worker.run_once()
    events = mirrored()
    assert set(events) == {mirror_uid(reservations[0].key), mirror_uid(reservations[2].key)}
    running = events[mirror_uid(reservations[0].key)]
    assert str(running[STATE_PROPERTY]) == "running"
    assert "ssh -p 2201 alice@gpu1.example.org" in str(running["DESCRIPTION"])
    # seen again: nothing new to write
    notes.seen([reservations[0], reservations[2]], set(), {"gpu1"})
    assert journal.writeback.due(datetime.now(UTC)) == []
    # the users' own calendar was never written to
    for booked in bookings[:1]:
        assert BLOCK_START not in booked.stored()


# starts a Radicale of its own (with a rights file): a service all the same
@pytest.mark.services
def test_the_writer_says_when_the_account_cannot_write(tmp_path: Path) -> None:
    server = rights_radicale(tmp_path / "radicale")
    try:
        from caldav.davclient import DAVClient

        owner: Any = DAVClient(url=server.url, username="owner", password="owner-password")
        owner.principal().make_calendar(name="shared", cal_id="shared")
        account = Account(
            f"{server.url}owner/shared/", server.username, server.password_file, None, "basic",
            True, "calendars[gpu1]",
        )  # fmt: skip
        problem = CalDAVWriter(account, 5).write_problem()
        assert problem is not None and "may not write" in problem
        own = Account(
            f"{server.url}{server.username}/", server.username, server.password_file, None,
            "basic", True, "calendars[gpu1]",
        )  # fmt: skip
        assert CalDAVWriter(own, 5).write_problem() is None
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("status", "one_object", "raised"),
    [
        (403, True, ObjectRefused),  # one event refused (private, too big): that one alone
        (403, False, WriteRefused),  # the calendar refused: write-back turned off
        (401, True, WriteRefused),  # the account's password: everywhere
        (412, True, WriteConflict),
        (500, True, WriteFailed),
    ],
)
def test_only_the_calendar_refusing_the_account_turns_write_back_off(
    status: int, one_object: bool, raised: type[Exception]
) -> None:
    account = Account("http://127.0.0.1:9/u/c/", None, None, None, "basic", True, "calendars[c]")
    with pytest.raises(raised):
        CalDAVWriter(account, 1)._raise_for(status, "No", "writing", one_object=one_object)
