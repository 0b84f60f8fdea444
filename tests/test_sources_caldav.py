"""The CalDAV source against a real Radicale, through the caldav client.

Sync tokens, their expiry (Radicale forgets them: its token store is
emptied, as its own clean-up does), a server without RFC 6578 (a real HTTP
proxy in front of Radicale that refuses sync-collection, as such servers
answer), the snapshot on disk across a restart with the server down.
"""

from __future__ import annotations

import http.client
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import RadicaleServer
from support.configs import config_of

from gpuresa.config.sections import Config
from gpuresa.reservations.calendars import Calendars
from gpuresa.reservations.sources import SourceError, open_source
from gpuresa.reservations.sources.caldav import CalDAVSource
from gpuresa.reservations.sources.snapshot import Changes

START = datetime(2026, 12, 1, 9, tzinfo=UTC)


def add_event(calendar: Any, uid: str, summary: str = "alice", day: int = 0) -> None:
    start = START + timedelta(days=day)
    calendar.save_event(
        dtstart=start,
        dtend=start + timedelta(hours=2),
        summary=summary,
        uid=uid,
        description="template: pytorch\ngpus: 1",
    )


def make_config(url: str, server: RadicaleServer, state: Path, **calendar: Any) -> Config:
    return config_of(
        {
            "daemon": {"host": "gpu1", "state_dir": str(state)},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "reservations": {"window_ahead": "1000d"},
            "calendars": [
                {
                    "name": "gpu1",
                    "url": url,
                    "host": "gpu1",
                    "username": server.username,
                    "password_file": str(server.password_file),
                    **calendar,
                }
            ],
        }
    )


def caldav_source(config: Config) -> CalDAVSource:
    source = open_source(config.calendars[0], config.daemon.state_dir)
    assert isinstance(source, CalDAVSource)
    return source


def names(objects: Any) -> set[str]:
    return {href.rsplit("/", 1)[-1] for href in objects}


@pytest.fixture
def filled(radicale: RadicaleServer, tmp_path: Path) -> tuple[Any, Config]:
    calendar = radicale.new_calendar()
    for uid in ("one", "two", "three"):
        add_event(calendar, uid)
    return calendar, make_config(str(calendar.url), radicale, tmp_path / "state")


def test_first_poll_lists_then_an_unchanged_calendar_costs_one_small_request(
    filled: tuple[Any, Config],
) -> None:
    _, config = filled
    source = caldav_source(config)
    first = source.poll()
    assert names(first.objects) == {"one.ics", "two.ics", "three.ics"}
    assert first.changed
    assert first.requests == 2  # the listing (sync-collection) and one multiget
    assert b"SUMMARY:alice" in next(iter(first.objects.values()))
    again = source.poll()
    assert not again.changed
    assert again.requests == 1
    assert again.bytes_received < first.bytes_received / 2
    assert again.objects == first.objects
    assert source.last_changes == Changes()


def test_the_next_sync_sees_exactly_the_changes(filled: tuple[Any, Config]) -> None:
    calendar, config = filled
    source = caldav_source(config)
    source.poll()
    modified = calendar.event_by_uid("one")
    modified.icalendar_component["SUMMARY"] = "bob"
    modified.save()
    calendar.event_by_uid("two").delete()
    add_event(calendar, "four", "carol")
    result = source.poll()
    assert result.changed
    assert result.requests == 2  # one sync-collection, one multiget of the 2 changed
    changes = source.last_changes
    assert (names(changes.added), names(changes.modified), names(changes.removed)) == (
        {"four.ics"},
        {"one.ics"},
        {"two.ics"},
    )
    assert names(result.objects) == {"one.ics", "three.ics", "four.ics"}
    by_name = {href.rsplit("/", 1)[-1]: data for href, data in result.objects.items()}
    assert b"SUMMARY:bob" in by_name["one.ics"]
    assert b"SUMMARY:carol" in by_name["four.ics"]


def test_an_expired_sync_token_falls_back_to_a_listing_with_etags(
    filled: tuple[Any, Config], radicale: RadicaleServer, caplog: pytest.LogCaptureFixture
) -> None:
    calendar, config = filled
    source = caldav_source(config)
    source.poll()
    # Radicale forgets every token of the collection, as its clean-up of old tokens does
    collection = radicale.storage / "collection-root" / radicale.username
    tokens = list(collection.glob("*/.Radicale.cache/sync-token"))
    assert tokens
    for folder in tokens:
        shutil.rmtree(folder)
    modified = calendar.event_by_uid("three")
    modified.icalendar_component["SUMMARY"] = "dave"
    modified.save()
    calendar.event_by_uid("one").delete()
    add_event(calendar, "five")
    with caplog.at_level("INFO", logger="gpuresa.reservations.sources.caldav"):
        result = source.poll()
    assert "refused the sync token (HTTP 403)" in caplog.text
    # the refused sync, the listing with ETags, one multiget of what changed: no duplicates
    assert result.requests == 3
    changes = source.last_changes
    assert (names(changes.added), names(changes.modified), names(changes.removed)) == (
        {"five.ics"},
        {"three.ics"},
        {"one.ics"},
    )
    assert names(result.objects) == {"two.ics", "three.ics", "five.ics"}
    # and the new token works again
    assert source.poll().requests == 1


def test_a_made_up_token_is_refused_and_nothing_is_fetched_twice(
    filled: tuple[Any, Config],
) -> None:
    _, config = filled
    source = caldav_source(config)
    first = source.poll()
    source.state.sync_token = "http://radicale.org/ns/sync/" + "0" * 64
    result = source.poll()
    assert result.requests == 2  # refused, then the listing; every ETag matched
    assert result.objects == first.objects
    assert not result.changed


LOGIN_PAGE = b"<!DOCTYPE html><html><body><form>Log in</form></body></html>"


class Proxy:
    """A real HTTP proxy to Radicale that can misbehave as servers in the wild do.

    `refuse_sync`: refuses sync-collection REPORTs (no RFC 6578). `login_page`:
    answers everything 200 with an HTML login page (a single sign-on portal in
    front of the server). `cut`: removes this text from REPORT answers (an
    object truncated on the server).
    """

    def __init__(self, target: str, *, refuse_sync: bool = False) -> None:
        self.target = urlsplit(target)
        self.refuse_sync = refuse_sync
        self.login_page = False
        self.cut: bytes | None = None
        # a REPORT whose request names this fails with HTTP 500
        self.fail_for: bytes | None = None
        self.refused = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self, status: int, content_type: str, content: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def do_request(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.login_page:
                    self.answer(200, "text/html; charset=utf-8", LOGIN_PAGE)
                    return
                if (
                    proxy.fail_for is not None
                    and self.command == "REPORT"
                    and proxy.fail_for in body
                ):
                    self.answer(500, "text/plain", b"cannot read the stored object")
                    return
                if proxy.refuse_sync and self.command == "REPORT" and b"sync-collection" in body:
                    proxy.refused += 1
                    self.answer(
                        403,
                        "application/xml",
                        b'<?xml version="1.0"?><D:error xmlns:D="DAV:">'
                        b"<D:supported-report/></D:error>",
                    )
                    return
                connection = http.client.HTTPConnection(
                    proxy.target.hostname or "127.0.0.1", proxy.target.port, timeout=30
                )
                # uncompressed, so that `cut` finds its text
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "accept-encoding")
                }
                connection.request(self.command, self.path, body, headers)
                response = connection.getresponse()
                content = response.read()
                if proxy.cut is not None and self.command == "REPORT":
                    content = content.replace(proxy.cut, b"")
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)
                connection.close()

            do_GET = do_PUT = do_DELETE = do_PROPFIND = do_REPORT = do_OPTIONS = do_request

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def refusing_proxy(radicale: RadicaleServer) -> Iterator[Proxy]:
    proxy = Proxy(radicale.url, refuse_sync=True)
    yield proxy
    proxy.close()


@pytest.fixture
def proxy(radicale: RadicaleServer) -> Iterator[Proxy]:
    proxy = Proxy(radicale.url)
    yield proxy
    proxy.close()


def test_a_server_without_sync_collection_is_listed_with_propfind(
    filled: tuple[Any, Config],
    radicale: RadicaleServer,
    refusing_proxy: Proxy,
    tmp_path: Path,
) -> None:
    calendar, _ = filled
    url = refusing_proxy.url(urlsplit(str(calendar.url)).path)
    source = caldav_source(make_config(url, radicale, tmp_path / "proxied"))
    first = source.poll()
    assert names(first.objects) == {"one.ics", "two.ics", "three.ics"}
    assert first.requests == 3  # the refused REPORT, a PROPFIND, one multiget
    assert refusing_proxy.refused == 1
    unchanged = source.poll()
    # remembered: straight to the PROPFIND listing; nothing fetched
    assert (unchanged.requests, unchanged.changed, refusing_proxy.refused) == (1, False, 1)
    modified = calendar.event_by_uid("two")
    modified.icalendar_component["SUMMARY"] = "erin"
    modified.save()
    calendar.event_by_uid("three").delete()
    result = source.poll()
    assert result.requests == 2
    assert names(source.last_changes.modified) == {"two.ics"}
    assert names(source.last_changes.removed) == {"three.ics"}
    assert names(result.objects) == {"one.ics", "two.ics"}


def test_a_restart_with_the_server_down_still_has_the_reservations(
    radicale_private: RadicaleServer, tmp_path: Path
) -> None:
    calendar = radicale_private.new_calendar()
    add_event(calendar, "kept", day=1)
    config = make_config(str(calendar.url), radicale_private, tmp_path / "state")
    now = datetime(2026, 11, 30, tzinfo=UTC)
    first = Calendars(config).poll(now)
    assert [item.key for item in first.reservations.reservations] == ["kept"]
    radicale_private.stop()
    # a new daemon: the snapshot comes from disk, the server is down
    restarted = Calendars(config)
    report = restarted.poll(now + timedelta(minutes=1))
    assert [item.key for item in report.reservations.reservations] == ["kept"]
    freshness = report.freshness["gpu1"]
    assert freshness.last_error is not None
    assert "Connection refused" in freshness.last_error
    assert freshness.last_success is not None and freshness.stale_seconds is not None
    assert freshness.stale_seconds > 0
    # the server is back: the stored sync token still serves, one request
    radicale_private.start()
    source = restarted.sources["gpu1"]
    again = source.poll()
    assert (again.requests, again.changed) == (1, False)
    assert restarted.poll(now).freshness["gpu1"].last_error is None


def test_a_wrong_password_is_a_clear_error(radicale: RadicaleServer, tmp_path: Path) -> None:
    calendar = radicale.new_calendar()
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    config = make_config(str(calendar.url), radicale, tmp_path / "state", password_file=str(wrong))
    with pytest.raises(SourceError) as caught:
        caldav_source(config).poll()
    assert str(caught.value) == (
        f"calendar gpu1: the server refused access to {radicale.url}{radicale.username}/… "
        "(HTTP 401); check username and password"
    )


def test_a_missing_password_file_is_a_clear_error(radicale: RadicaleServer, tmp_path: Path) -> None:
    config = make_config(
        radicale.url + "gpuresa/none/", radicale, tmp_path, password_file=str(tmp_path / "nope")
    )
    with pytest.raises(SourceError, match=r"cannot read secret file .*/nope"):
        caldav_source(config).poll()


def test_a_missing_calendar_is_a_clear_error(radicale: RadicaleServer, tmp_path: Path) -> None:
    url = f"{radicale.url}{radicale.username}/{uuid.uuid4().hex}/"
    with pytest.raises(SourceError, match=r"calendar gpu1: listing .* failed \(HTTP 404"):
        caldav_source(make_config(url, radicale, tmp_path)).poll()


# --- bad answers never read as an empty calendar ------------------------------------------------


def test_a_login_page_instead_of_the_server_keeps_the_snapshot(
    filled: tuple[Any, Config], radicale: RadicaleServer, proxy: Proxy, tmp_path: Path
) -> None:
    calendar, _ = filled
    url = proxy.url(urlsplit(str(calendar.url)).path)
    config = make_config(url, radicale, tmp_path / "state")
    source = caldav_source(config)
    good = dict(source.poll().objects)
    assert names(good) == {"one.ics", "two.ics", "three.ics"}
    proxy.login_page = True
    with pytest.raises(SourceError, match=r"^calendar gpu1: listing http://127\.0\.0\.1:\d+/"):
        source.poll()
    source.state.sync_token = None  # and without a sync token, straight to the listing
    with pytest.raises(SourceError) as caught:
        source.poll()
    assert "\n" not in str(caught.value)
    assert "not a WebDAV answer" in str(caught.value)
    assert source.snapshot() == good
    # a login page refuses sync-collection too: no reason to give up on it for good
    assert source.state.sync_supported is True
    assert caldav_source(config).snapshot() == good  # on disk too


def test_a_truncated_object_fails_alone_and_keeps_its_last_good_copy(
    filled: tuple[Any, Config], radicale: RadicaleServer, proxy: Proxy, tmp_path: Path
) -> None:
    calendar, _ = filled
    url = proxy.url(urlsplit(str(calendar.url)).path)
    config = make_config(url, radicale, tmp_path / "state")
    source = caldav_source(config)
    good = dict(source.poll().objects)
    modified = calendar.event_by_uid("one")
    modified.icalendar_component["SUMMARY"] = "bob"
    modified.save()
    proxy.cut = b"END:VCALENDAR"
    result = source.poll()
    [(href, problem)] = result.problems.items()
    assert names([href]) == {"one.ics"}
    assert re.fullmatch(
        r"object one\.ics from http://127\.0\.0\.1:\d+/gpuresa/…: it is incomplete.*", problem
    )
    assert result.objects == good
    assert caldav_source(config).snapshot() == good
    # the server is whole again: the change the failed poll saw is fetched, not skipped
    proxy.cut = None
    result = source.poll()
    assert result.changed and result.problems == {}
    assert names(source.last_changes.modified) == {"one.ics"}
    assert names(result.objects) == {"one.ics", "two.ics", "three.ics"}


def test_an_object_the_server_cannot_send_fails_alone(
    filled: tuple[Any, Config], radicale: RadicaleServer, proxy: Proxy, tmp_path: Path
) -> None:
    calendar, _ = filled
    url = proxy.url(urlsplit(str(calendar.url)).path)
    config = make_config(url, radicale, tmp_path / "state")
    source = caldav_source(config)
    good = dict(source.poll().objects)
    modified = calendar.event_by_uid("one")
    modified.icalendar_component["SUMMARY"] = "bob"
    modified.save()
    add_event(calendar, "four", day=1)
    # every multiget that asks for one.ics fails as a whole, as a server whose copy of
    # that object is damaged answers
    proxy.fail_for = b"one.ics"
    result = source.poll()
    assert names(result.problems) == {"one.ics"}
    assert "HTTP 500" in next(iter(result.problems.values()))
    assert names(result.objects) == {"one.ics", "two.ics", "three.ics", "four.ics"}
    one = next(href for href in good if href.endswith("/one.ics"))
    assert result.objects[one] == good[one]  # a flaky fetch cancels nothing
    # read through the calendars: one's booking stays, and its object is refused alone
    report = Calendars(config, sources={"gpu1": source}).poll(START - timedelta(days=1))
    assert {item.key for item in report.reservations.reservations} == {
        "one",
        "two",
        "three",
        "four",
    }
    [refused] = report.reservations.rejected
    assert refused.key == one and refused.user is None and refused.start is None
    assert "its last good copy is used" in refused.reason
    # a sync from where this poll stood still names one.ics: fetched once the server can
    proxy.fail_for = None
    result = source.poll()
    assert result.problems == {} and b"SUMMARY:bob" in result.objects[one]
