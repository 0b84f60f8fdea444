"""The outbox against real aiosmtpd servers and a relay that never answers: mail waits,
nothing else does; nothing is lost or sent twice across restarts."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import SMTPServer, free_port
from support.waiting import wait_for

from gpuresa.config.reporting_sections import NotifyConfig
from gpuresa.config.sections import UsersConfig
from gpuresa.journal.store import Journal
from gpuresa.mail.outbox import RETRY_DELAYS, Outbox, retry_delay
from gpuresa.mail.smtp import Notifier

START = datetime(2024, 5, 3, 12, 0, tzinfo=UTC)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now

    def advance(self, delta: timedelta) -> None:
        self.now += delta


def notifier(port: int, **changes: object) -> Notifier:
    config = NotifyConfig(
        enabled=True,
        smtp_host="127.0.0.1",
        smtp_port=port,
        sender="gpuresa@example.org",
        timeout=timedelta(seconds=3),
        **changes,  # type: ignore[arg-type]
    )
    return Notifier(config, UsersConfig())


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal(tmp_path / "journal.sqlite") as opened:
        yield opened


@dataclass(frozen=True)
class SilentRelay:
    """Where the relay listens, and the connections it took (open, never answered)."""

    port: int
    accepted: list[socket.socket]


@pytest.fixture
def silent_relay() -> Iterator[SilentRelay]:
    """A relay that accepts TCP connections and never says a word (no SMTP greeting)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        accepted: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            server.settimeout(0.2)
            while not stop.is_set():
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                accepted.append(connection)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield SilentRelay(server.getsockname()[1], accepted)
        finally:
            stop.set()
            thread.join(2)
            for connection in accepted:
                connection.close()


def stopped(outbox: Outbox) -> None:
    """Stop the outbox and wait for its worker to end: it sends nothing more after that."""
    outbox.stop()
    assert outbox._thread is not None
    outbox._thread.join(10)
    assert not outbox._thread.is_alive()


def test_retry_delays_grow_then_stay_at_the_last() -> None:
    assert [retry_delay(attempt) for attempt in range(1, 8)] == [
        timedelta(seconds=15),
        timedelta(minutes=1),
        timedelta(minutes=5),
        timedelta(minutes=15),
        timedelta(minutes=30),
        timedelta(minutes=30),
        timedelta(minutes=30),
    ]
    assert RETRY_DELAYS[-1] == timedelta(minutes=30)


def test_a_relay_that_never_answers_delays_nothing_but_mail(
    journal: Journal, silent_relay: SilentRelay, smtp_server: SMTPServer
) -> None:
    clock = Clock()
    outbox = Outbox(journal, notifier(silent_relay.port), clock)
    outbox.start()
    began = time.monotonic()
    assert outbox.enqueue("r1", "start", "alice@example.org", "Your session", "ssh …")
    assert time.monotonic() - began < 0.5
    # the worker is now stuck in the SMTP greeting, for up to notify.timeout (3 s)
    wait_for(lambda: outbox._thread is not None and outbox.backlog() == 1, 5, "the send under way")
    wait_for(lambda: silent_relay.accepted, 5, "the worker's connection to the relay")
    began = time.monotonic()
    outbox.stop(timeout=1.0)
    assert time.monotonic() - began < 1.5
    # the stuck attempt ends with the SMTP timeout and is journaled as failed
    assert outbox._thread is not None
    outbox._thread.join(10)
    [waiting] = outbox.pending()
    assert (waiting.key, waiting.kind, waiting.attempts) == ("r1", "start", 1)
    assert "did not answer" in (waiting.last_error or "")
    assert waiting.next_try == START + timedelta(seconds=15)
    assert smtp_server.messages == []

    # the admin fixes the relay (a config reload); the retry delivers it once
    outbox.set_notifier(notifier(smtp_server.port))
    outbox.start()
    time.sleep(0.5)
    assert smtp_server.messages == []  # not before its next try
    clock.advance(timedelta(seconds=16))
    outbox.wake()
    [message] = smtp_server.wait_for(1)
    assert message["Subject"] == "Your session" and message["To"] == "alice@example.org"
    wait_for(lambda: outbox.backlog() == 0, 15, "an empty outbox")
    assert outbox.sent("r1", "start")
    stopped(outbox)
    assert len(smtp_server.messages) == 1


def test_a_restart_sends_what_was_not_sent_and_nothing_twice(
    tmp_path: Path, smtp_server: SMTPServer
) -> None:
    path = tmp_path / "journal.sqlite"
    clock = Clock()
    first_journal = Journal(path)
    first = Outbox(first_journal, notifier(smtp_server.port), clock)
    first.start()
    assert first.enqueue("r1", "start", "alice@example.org", "started", "body")
    smtp_server.wait_for(1)
    wait_for(lambda: first.sent("r1", "start"), 15, "the notice sent")
    first.stop()
    # queued but never sent: the daemon is killed before the worker runs again
    assert first.enqueue("r1", "end", "alice@example.org", "ended", "body")
    assert first.enqueue("r2", None, "bob@example.org", "note", "body")
    first_journal.close()

    second_journal = Journal(path)
    second = Outbox(second_journal, notifier(smtp_server.port), clock)
    assert second.backlog() == 2
    assert not second.enqueue("r1", "start", "alice@example.org", "started", "body")
    assert not second.enqueue("r1", "end", "alice@example.org", "ended", "body")
    second.start()
    messages = smtp_server.wait_for(3)
    wait_for(lambda: second.backlog() == 0, 15, "an empty outbox")
    stopped(second)
    assert sorted(message["Subject"] for message in smtp_server.messages) == [
        "ended",
        "note",
        "started",
    ]
    assert len(messages) == 3
    second_journal.close()


def test_notices_are_deduplicated_by_key_and_kind(journal: Journal) -> None:
    outbox = Outbox(journal, notifier(free_port()), Clock())
    assert outbox.enqueue("r1", "start", "alice@example.org", "s", "b")
    assert not outbox.enqueue("r1", "start", "alice@example.org", "s again", "b")
    assert outbox.enqueue("r2", "start", "bob@example.org", "s", "b")
    assert outbox.enqueue("r1", "warning-900-2024-05-03T16:00:00+00:00", "a@example.org", "w", "b")
    # a kind of None is never deduplicated
    assert outbox.enqueue("r1", None, "alice@example.org", "n", "b")
    assert outbox.enqueue("r1", None, "alice@example.org", "n", "b")
    assert outbox.backlog() == 5
    assert not outbox.sent("r1", "start")
    # a notice claimed before the outbox existed is not queued again
    journal.notices.claim("r3", "end", START)
    assert not outbox.enqueue("r3", "end", "carol@example.org", "e", "b")
    # a withdrawn notice (new containers, new password) can be queued again
    journal.notices.release("r1", "start")
    assert outbox.enqueue("r1", "start", "alice@example.org", "new details", "b")


def test_a_message_failing_for_too_long_is_dropped_and_journaled(journal: Journal) -> None:
    clock = Clock()
    closed = free_port()  # nothing listens: every attempt is refused at once
    outbox = Outbox(journal, notifier(closed, give_up_after=timedelta(hours=1)), clock)
    outbox.enqueue("r1", "end", "alice@example.org", "ended", "body")
    outbox.start()
    wait_for(lambda: outbox.pending()[0].attempts == 1, 15, "a first attempt")
    assert "cannot reach" in (outbox.pending()[0].last_error or "")
    clock.advance(timedelta(hours=2))
    outbox.wake()
    wait_for(lambda: outbox.backlog() == 0, 15, "an empty outbox")
    outbox.stop()
    assert not outbox.sent("r1", "end")
    [entry] = [item for item in journal.history.entries() if item.key == "r1"]
    assert entry.what == "mail 'ended' dropped: failed"
    assert "notify.give_up_after" in entry.detail and "cannot reach" in entry.detail


def test_an_invalid_address_is_dropped_at_once(journal: Journal, smtp_server: SMTPServer) -> None:
    outbox = Outbox(journal, notifier(smtp_server.port), Clock())
    outbox.enqueue("r1", "start", "not an address", "s", "b")
    outbox.enqueue("r2", "start", "bob@example.org", "s", "b")
    outbox.start()
    smtp_server.wait_for(1)
    wait_for(lambda: outbox.backlog() == 0, 15, "an empty outbox")
    outbox.stop()
    assert [item.detail for item in journal.history.entries() if item.key == "r1"] == [
        "not a valid e-mail address: not an address"
    ]


def test_status_shows_the_backlog_and_the_oldest_unsent_with_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuresa.cli import main

    state = tmp_path / "state"
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{state}"\n[[hosts]]\nname = "gpu1"\ngpus = [0]\n'
    )
    with Journal(state / "journal.sqlite") as journal:
        clock = Clock()
        outbox = Outbox(journal, notifier(free_port()), clock)
        outbox.enqueue("r1", "start", "alice@example.org", "started", "body")
        clock.advance(timedelta(minutes=1))
        outbox.enqueue("r2", "end", "bob@example.org", "ended", "body")
        outbox.start()
        wait_for(lambda: all(item.attempts == 1 for item in outbox.pending()), 15, "first attempts")
        outbox.stop()
    assert main(["status", "--json", "--config", str(config)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outbox"]["backlog"] == 2
    oldest = report["outbox"]["oldest"][0]
    assert (oldest["key"], oldest["kind"], oldest["attempts"]) == ("r1", "start", 1)
    assert "cannot reach" in oldest["last_error"]
    assert main(["status", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "outbox: 2 e-mail(s) waiting" in text
    assert "r1" in text and "cannot reach" in text
