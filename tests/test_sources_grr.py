"""GRR's database as a calendar: a real MariaDB, GRR's tables, rows as GRR writes them."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from grr_database import PORT, GRRDatabase

from gpuresa.cli import main
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.errors import ConfigError
from gpuresa.model import ReservationSet
from gpuresa.reservations.calendars import Calendars
from gpuresa.reservations.rules import read_reservations
from gpuresa.reservations.sources import SourceError, grr_connection, open_source
from gpuresa.reservations.sources.grr import GRRSource

VARIANTS = {"pytorch": ("12.4", "11.8"), "tensorflow": ("12.3",)}
NOW = datetime.now(UTC).replace(microsecond=0)
HOUR = timedelta(hours=1)


def make_config(calendar: dict[str, object], **more: Any) -> Config:
    return parse_config(
        {
            "daemon": {"host": "gpu1"},
            "reservations": {"timezone": "Europe/Paris"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1]}, {"name": "gpu2", "gpus": [0, 1, 2, 3]}],
            "calendars": [calendar],
            **more,
        }
    )


def source_of(config: Config, state: Path | None) -> GRRSource:
    source = open_source(config.calendars[0], state, reservations=config.reservations)
    assert isinstance(source, GRRSource)
    return source


def read(config: Config, source: GRRSource, now: datetime = NOW) -> ReservationSet:
    objects = source.poll(now).objects
    window = config.reservations
    return read_reservations(
        config,
        {"grr": list(objects.items())},
        now - window.window_past,
        now + window.window_ahead,
        variants=VARIANTS,
    )


@pytest.fixture
def lab(grr_database: GRRDatabase) -> dict[str, int]:
    """Two GPU rooms, a room booked by periods, a meeting room; alice and bob."""
    database = grr_database
    area = database.add_area("Serveurs GPU")
    periods = database.add_area("Salles de TP", periods=True)
    rooms = {
        "gpu1": database.add_room("GPU 1", area),
        "gpu2": database.add_room("GPU 2", area),
        "periods": database.add_room("TP GPU", periods),
        "meeting": database.add_room("Salle de réunion", area),
    }
    database.add_user("alice", "alice.martin@example.org")
    database.add_user("bob", "bob@example.org")
    database.add_user("carol", "carol@example.org", state="inactif")
    return rooms


ROOMS = {"GPU 1": "gpu1", "GPU 2": "gpu2", "TP GPU": "gpu1"}


def test_rows_become_what_a_calendar_gives(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    start = NOW + 2 * HOUR
    single = database.book(
        lab["gpu1"], start, start + 2 * HOUR, "alice", "template: pytorch\ngpus: 2"
    )
    series = database.book_weekly(
        lab["gpu2"], start, 3 * HOUR, 4, "bob", "template: tensorflow<br>gpus: 3"
    )
    database.move(series[1], start + timedelta(days=8), start + timedelta(days=8, hours=1))
    database.delete(series[2])
    pending = database.book(lab["gpu1"], start + 5 * HOUR, start + 6 * HOUR, "bob", moderate=1)
    accepted = database.book(lab["gpu1"], start + 7 * HOUR, start + 8 * HOUR, "bob")
    database.moderate(accepted, 1)
    database.moderate(accepted, 2)
    refused = database.book(lab["gpu1"], start + 9 * HOUR, start + 10 * HOUR, "bob", moderate=3)
    deleted = database.book(lab["gpu2"], start + 20 * HOUR, start + 21 * HOUR, "alice")
    database.delete(deleted)
    by_periods = database.book(lab["periods"], start, start + HOUR, "alice")
    database.book(lab["meeting"], start, start + HOUR, "alice")  # no host: ignored
    config = make_config(
        database.calendar(ROOMS, default_template="pytorch"),
        reservations={"timezone": "UTC", "window_ahead": "30d"},
    )
    found = read(config, source_of(config, tmp_path))
    kept = {item.key: item for item in found.reservations}
    key = f"grr:{database.prefix}:"
    assert sorted(kept) == sorted(
        f"{key}{number}" for number in (single, series[0], series[1], series[3], accepted)
    )
    first = kept[f"{key}{single}"]
    assert (first.host, first.user, first.template, first.cuda, first.gpus) == (
        "gpu1", "alice", "pytorch", "12.4", 2,
    )  # fmt: skip
    assert (first.start, first.end) == (start, start + 2 * HOUR)
    assert first.email == "alice.martin@example.org"
    weekly = [kept[f"{key}{number}"] for number in (series[0], series[1], series[3])]
    assert [(item.host, item.user, item.template, item.gpus) for item in weekly] == [
        ("gpu2", "bob", "tensorflow", 3)
    ] * 3
    # the occurrence moved on its own: same key, its new time
    assert (weekly[1].start, weekly[1].end) == (
        start + timedelta(days=8), start + timedelta(days=8, hours=1),
    )  # fmt: skip
    assert weekly[2].start == start + timedelta(weeks=3)
    rejected = {item.key: item.reason for item in found.rejected}
    assert list(rejected) == [f"{key}{by_periods}"]
    assert "books by periods" in rejected[f"{key}{by_periods}"]
    for absent in (pending, refused, deleted):
        assert f"{key}{absent}" not in kept


def test_bad_rows_are_refused_alone_each_with_its_reason(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    start = NOW + HOUR
    good = database.book(lab["gpu1"], start, start + HOUR, "alice", "template: pytorch")
    backwards = database.book(lab["gpu1"], start + 3 * HOUR, start + 2 * HOUR, "alice")
    unknown = database.book(lab["gpu2"], start, start + HOUR, "mallory")
    disabled = database.book(lab["gpu2"], start + 2 * HOUR, start + 3 * HOUR, "carol")
    outside = database.book(lab["gpu2"], start + 4 * HOUR, start + 5 * HOUR, "", outside="Eve|e@x")
    too_many = database.book(lab["gpu1"], start + 4 * HOUR, start + 5 * HOUR, "bob", "gpus: 8")
    no_cuda = database.book(lab["gpu2"], start + 6 * HOUR, start + 7 * HOUR, "bob", "cuda: 9.0")
    # text that tries to end the event and add one of its own
    injected = database.book(
        lab["gpu2"], start + 8 * HOUR, start + 9 * HOUR, "bob",
        "template: pytorch\r\nEND:VEVENT\r\nBEGIN:VEVENT\r\nUID:x\r\nSUMMARY:root\r\n"
        "DTSTART:20300101T000000Z\r\nX-GPURESA-REFUSED:no",
    )  # fmt: skip
    config = make_config(database.calendar(ROOMS, default_template="pytorch"))
    found = read(config, source_of(config, tmp_path))
    key = f"grr:{database.prefix}:"
    assert [item.key for item in found.reservations] == [f"{key}{good}", f"{key}{injected}"]
    assert found.reservations[1].user == "bob"
    reasons = {item.key.removeprefix(key): item.reason for item in found.rejected}
    assert "ends before it starts" in reasons[str(backwards)]
    assert "'MALLORY' is no GRR account (unknown login)" in reasons[str(unknown)]
    assert "disabled in GRR" in reasons[str(disabled)]
    assert "outside GRR ('Eve')" in reasons[str(outside)]
    assert "8 GPUs asked, but host 'gpu1' has 2" in reasons[str(too_many)]
    assert "CUDA '9.0' is not available" in reasons[str(no_cuda)]
    assert len(reasons) == 6


def test_a_refusal_speaks_of_the_beneficiary_as_grr_admins_know_it(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    """GRR shows a booking's short description (`name`) as its title: a refusal about the
    login names the field it came from, the beneficiary, and never "the title"."""
    database = grr_database
    database.add_user("jean.dupont", "jean.dupont@example.org")  # a GRR login, no Unix one
    entry = database.book(lab["gpu1"], NOW + HOUR, NOW + 2 * HOUR, "jean.dupont")
    config = make_config(database.calendar(ROOMS, default_template="pytorch"))
    found = read(config, source_of(config, tmp_path))
    [rejection] = [item for item in found.rejected if item.key.endswith(f":{entry}")]
    assert rejection.reason.startswith(
        "'jean.dupont' (from the booking's beneficiary (GRR's \"beneficiaire\", not its short "
        'description "name")) is not a login'
    ), rejection.reason
    assert "title" not in rejection.reason and "SUMMARY" not in rejection.reason


def test_only_the_fixed_phrases_of_x_gpuresa_summary_are_used() -> None:
    """A calendar event that sets the property itself can make its refusal say nothing else."""
    config = make_config({"name": "c", "kind": "ics", "url": "/x", "host": "gpu1"})
    event = (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:t\r\nBEGIN:VEVENT\r\nUID:u1\r\n"
        f"DTSTART:{(NOW + HOUR):%Y%m%dT%H%M%SZ}\r\nDTEND:{(NOW + 2 * HOUR):%Y%m%dT%H%M%SZ}\r\n"
        "SUMMARY:Not A Login\r\nX-GPURESA-SUMMARY:the admin's own approval\r\n"
        "END:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    found = read_reservations(
        config, {"c": [("a.ics", event)]}, NOW - HOUR, NOW + 5 * HOUR, variants=VARIANTS
    )
    [rejection] = found.rejected
    assert "(from the title) is not a login" in rejection.reason
    assert "approval" not in rejection.reason


def test_the_login_can_come_from_the_accounts_email(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    entry = database.book(lab["gpu1"], NOW + HOUR, NOW + 2 * HOUR, "alice")
    config = make_config(
        database.calendar(
            ROOMS, default_template="pytorch", user_from="organizer",
            email_logins={"alice.martin@example.org": "amartin"},
        )
    )  # fmt: skip
    found = read(config, source_of(config, tmp_path))
    assert [(item.key, item.user) for item in found.reservations] == [
        (f"grr:grr_:{entry}", "amartin")
    ]


def test_an_unchanged_poll_is_one_small_query(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    entry = database.book(lab["gpu1"], NOW + HOUR, NOW + 2 * HOUR, "alice", "template: pytorch")
    far = database.book(lab["gpu1"], NOW + timedelta(days=30), NOW + timedelta(days=31), "bob")
    config = make_config(database.calendar(ROOMS))
    source = source_of(config, tmp_path)
    time.sleep(2.1)  # the rows' stamps settle (a second's resolution)
    first = source.poll(NOW)
    assert first.changed and first.requests > 1
    assert list(first.objects) == [f"entry-{entry}.ics"]  # only the window is read
    again = source.poll(NOW + timedelta(seconds=30))
    assert (again.changed, again.requests, again.bytes_received) == (False, 1, 0)
    # an edit, a soft deletion, a row coming into the window: each is seen
    database.set_description(entry, "template: pytorch\ngpus: 2")
    edited = source.poll(NOW + timedelta(seconds=60))
    assert edited.changed and b"gpus: 2" in edited.objects[f"entry-{entry}.ics"]
    database.delete(entry)
    assert source.poll(NOW + timedelta(seconds=90)).objects == {}
    assert f"entry-{far}.ics" in source.poll(NOW + timedelta(days=20)).objects


def test_a_write_in_the_stamps_second_is_not_missed(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    entry = database.book(lab["gpu1"], NOW + HOUR, NOW + 2 * HOUR, "alice", "gpus: 1")
    config = make_config(database.calendar(ROOMS))
    source = source_of(config, tmp_path)
    source.poll(NOW)  # within the row's second: not trusted as unchanged
    # a second write in the same second leaves the stamp as it was
    database.execute(
        "UPDATE grr_entry SET description = 'gpus: 2', `timestamp` = `timestamp` WHERE id = %s",
        (entry,),
    )
    assert b"gpus: 2" in source.poll(NOW).objects[f"entry-{entry}.ics"]


def test_a_renamed_room_keeps_the_snapshot(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    database.book(lab["gpu1"], NOW + HOUR, NOW + 2 * HOUR, "alice")
    config = make_config(database.calendar({"GPU 1": "gpu1", "#" + str(lab["gpu2"]): "gpu2"}))
    source = source_of(config, tmp_path)
    kept = dict(source.poll(NOW).objects)
    assert len(kept) == 1
    database.execute("UPDATE grr_room SET room_name = 'GPU one' WHERE id = %s", (lab["gpu1"],))
    database.book(lab["gpu2"], NOW + HOUR, NOW + 2 * HOUR, "alice")
    with pytest.raises(SourceError, match="no GRR room named 'GPU 1'"):
        source.poll(NOW + timedelta(minutes=11))
    assert dict(source.snapshot()) == kept
    # a restart has the snapshot before the database answers
    assert dict(source_of(config, tmp_path).snapshot()) == kept


# --- outages ----------------------------------------------------------------------------------


class Proxy:
    """A TCP relay to MariaDB that can be made to hang: it accepts, and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hanging = False
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.open.append(client)
            if self.hanging:
                continue  # accepted, never answered
            server = socket.create_connection(("127.0.0.1", PORT))
            self.open.append(server)
            for one, other in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(one, other), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                while self.hanging:
                    time.sleep(0.05)  # what is in flight stops here
                target.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for item in self.open:
            item.close()


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    relay = Proxy()
    yield relay
    relay.close()


def test_a_hanging_database_keeps_the_snapshot_and_delays_no_other_calendar(
    grr_database: GRRDatabase,
    lab: dict[str, int],
    proxy: Proxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grr_connection, "POLL_DEADLINE", 2.0)
    database = grr_database
    entry = database.book(lab["gpu1"], NOW + HOUR, NOW + 2 * HOUR, "alice", "template: pytorch")
    ics = tmp_path / "other.ics"
    ics.write_text(
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:t\r\nBEGIN:VEVENT\r\nUID:other\r\n"
        f"DTSTART:{(NOW + HOUR).strftime('%Y%m%dT%H%M%SZ')}\r\n"
        f"DTEND:{(NOW + 2 * HOUR).strftime('%Y%m%dT%H%M%SZ')}\r\n"
        "SUMMARY:bob\r\nDESCRIPTION:template: pytorch\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    grr = database.calendar(ROOMS)
    grr.pop("unix_socket")
    grr["url"] = f"mysql://127.0.0.1:{proxy.port}/{database.name}"
    config = make_config(
        grr,
        daemon={"host": "gpu1", "state_dir": str(tmp_path / "state")},
    )
    config = parse_config(
        {
            "daemon": {"host": "gpu1", "state_dir": str(tmp_path / "state")},
            "hosts": [{"name": "gpu1", "gpus": [0, 1]}, {"name": "gpu2", "gpus": [0, 1]}],
            "calendars": [
                grr,
                {"name": "other", "kind": "ics", "url": str(ics), "host": "gpu2"},
            ],
        }
    )
    calendars = Calendars(config)
    import gpuresa.reservations.catalog

    monkeypatch.setattr(gpuresa.reservations.catalog, "template_variants", lambda config: VARIANTS)
    first = calendars.poll(NOW)
    keys = sorted(item.key for item in first.reservations.reservations)
    assert keys == [f"grr:grr_:{entry}", "other"]
    for hang_while in ("a query", "the connection"):
        proxy.hanging = True
        if hang_while == "the connection":
            calendars.sources["grr"]._close()  # type: ignore[attr-defined]
        began = time.monotonic()
        during = calendars.poll(NOW + timedelta(seconds=30))
        took = time.monotonic() - began
        assert took < 3.5, f"a hanging database held the poll {took:.1f}s ({hang_while})"
        assert sorted(item.key for item in during.reservations.reservations) == keys
        error = during.freshness["grr"].last_error
        assert error is not None and "cannot read the GRR database" in error
        assert "no answer within 2s (connection and queries together)" in error, error
        assert during.freshness["other"].last_error is None
        proxy.hanging = False
    after = calendars.poll(NOW + timedelta(seconds=60))
    assert after.freshness["grr"].last_error is None


def test_a_deadline_is_over_when_its_time_is_even_if_its_timer_has_not_run_yet() -> None:
    """A socket timeout set to the time left can fire before the deadline's timer thread is
    scheduled (a loaded machine): the poll must still say the deadline passed."""
    over = grr_connection.Deadline(0)
    assert over.passed() and not over.expired
    assert not grr_connection.Deadline(60).passed()


def test_a_refused_password_is_an_outage_with_its_reason(
    grr_database: GRRDatabase, lab: dict[str, int], tmp_path: Path
) -> None:
    database = grr_database
    database.password_file.write_text("wrong\n")
    config = make_config(database.calendar(ROOMS))
    with pytest.raises(SourceError, match="Access denied") as caught:
        source_of(config, tmp_path).poll(NOW)
    assert "wrong" not in str(caught.value)
    database.password_file.unlink()
    with pytest.raises(SourceError, match="cannot read secret file"):
        source_of(config, tmp_path).poll(NOW)


def test_the_account_only_reads(grr_database: GRRDatabase, lab: dict[str, int]) -> None:
    database = grr_database
    config = make_config(database.calendar(ROOMS))
    connection: Any
    connection, _ = grr_connection.connect(config.calendars[0], grr_connection.Deadline())
    try:
        with pytest.raises(Exception, match="command denied"):
            connection.cursor().execute("DELETE FROM grr_entry")
    finally:
        connection.close()


class SilentServer:
    """A TCP listener that accepts every connection and never answers, or (`drip`) sends
    the start of a MySQL greeting one byte at a time, each well within a socket timeout."""

    def __init__(self, drip: float | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.drip = drip
        self.accepted: list[socket.socket] = []
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(client)
            if self.drip is not None:
                threading.Thread(target=self._send_slowly, args=(client,), daemon=True).start()

    def _send_slowly(self, client: socket.socket) -> None:
        greeting = b"\xff\x00\x00\x00\x0a5.5.5-10.11.6-MariaDB" * 10
        for byte in greeting:
            if self.stopped.wait(self.drip):
                return
            try:
                client.send(bytes([byte]))
            except OSError:
                return

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()
        for client in self.accepted:
            client.close()


def silent_source(tmp_path: Path, server: SilentServer) -> GRRSource:
    password = tmp_path / "password"
    password.write_text("unused\n")
    config = make_config(
        {"name": "grr", "kind": "grr", "url": f"mysql://127.0.0.1:{server.port}/grr",
         "username": "gpuresa", "password_file": str(password), "rooms": ROOMS}
    )  # fmt: skip
    return source_of(config, None)


def test_a_database_that_accepts_and_never_answers_holds_a_poll_for_the_deadline(
    tmp_path: Path,
) -> None:
    """10 s, the README's, for the connection, the login and the queries together."""
    server = SilentServer()
    try:
        source = silent_source(tmp_path, server)
        began = time.monotonic()
        with pytest.raises(SourceError) as caught:
            source.poll(NOW)
        took = time.monotonic() - began
    finally:
        server.close()
    assert grr_connection.POLL_DEADLINE == 10.0
    assert 9.9 <= took < 11, f"the poll took {took:.1f}s"
    assert "no answer within 10s (connection and queries together)" in str(caught.value)


def test_a_database_that_answers_a_byte_at_a_time_is_cut_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each byte comes well within any socket timeout: only the one deadline ends it."""
    monkeypatch.setattr(grr_connection, "POLL_DEADLINE", 2.0)
    server = SilentServer(drip=0.3)
    try:
        source = silent_source(tmp_path, server)
        began = time.monotonic()
        with pytest.raises(SourceError, match="no answer within 2s"):
            source.poll(NOW)
        took = time.monotonic() - began
    finally:
        server.close()
    assert 1.9 <= took < 3, f"the poll took {took:.1f}s"


# --- config and the command ---------------------------------------------------------------------


def test_config_problems_name_their_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        make_config(
            {"name": "grr", "kind": "grr", "url": "http://db/grr", "host": "gpu1",
             "rooms": {"GPU 1": "gpu9", "#x": "gpu1"}, "user_from": "attendee"}
        )  # fmt: skip
    problems = "\n".join(caught.value.problems)
    for expected in (
        "calendars[grr].url: a grr calendar needs mysql://",
        "calendars[grr].username:",
        "calendars[grr].password_file:",
        "calendars[grr].host:",
        "calendars[grr].user_from:",
        "calendars[grr].rooms.GPU 1: 'gpu9' is not one of the [[hosts]]",
        "calendars[grr].rooms.#x:",
    ):
        assert expected in problems, problems
    # the prefix is part of SQL statements: letters, digits and '_' only
    with pytest.raises(ConfigError, match=r"calendars\[g\].table_prefix: expected letters"):
        make_config({"name": "g", "kind": "grr", "url": "mysql://db/grr", "table_prefix": "a;b"})
    with pytest.raises(ConfigError, match=r"calendars\[c\].rooms: only for a calendar of kind"):
        make_config({"name": "c", "url": "https://x/", "rooms": {"a": "gpu1"}})


def test_cli_reservations_shows_what_gpuresa_makes_of_the_database(
    grr_database: GRRDatabase,
    lab: dict[str, int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    database = grr_database
    later = NOW + timedelta(days=40)  # outside the daemon's window: --from/--to decide
    good = database.book(lab["gpu1"], later, later + HOUR, "alice", "template: pytorch")
    bad = database.book(lab["periods"], later, later + HOUR, "alice", "template: pytorch")
    calendar = database.calendar(ROOMS)
    rooms = ", ".join(f'"{name}" = "{host}"' for name, host in ROOMS.items())
    lines = "\n".join(
        f"{name} = {json.dumps(value)}" for name, value in calendar.items() if name != "rooms"
    )
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{tmp_path / "state"}"\n'
        '[[hosts]]\nname = "gpu1"\ngpus = [0, 1]\n[[hosts]]\nname = "gpu2"\ngpus = [0]\n'
        f"[[calendars]]\n{lines}\nrooms = {{ {rooms} }}\n"
    )
    day = later.date()
    arguments = ["--config", str(config), "reservations", "--calendar", "grr"]
    window = ["--from", str(day), "--to", str(day + timedelta(days=2))]
    assert main([*arguments, *window, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [item["key"] for item in document["reservations"]] == [f"grr:grr_:{good}"]
    assert [item["key"] for item in document["rejected"]] == [f"grr:grr_:{bad}"]
    assert main([*arguments, *window]) == 0
    shown = capsys.readouterr().out
    assert f"grr:grr_:{good}" in shown and "books by periods" in shown
