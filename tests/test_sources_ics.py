"""ICS sources: a file, a folder, and an http(s) feed served by a real local HTTP server."""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.reading import parse_config
from gpuresa.reservations.sources import SourceError, open_source, shown_url
from gpuresa.reservations.sources.ics import ICSSource

FEED = (
    b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:feed\r\nBEGIN:VEVENT\r\nUID:f1\r\n"
    b"DTSTART:20261201T090000Z\r\nDTEND:20261201T100000Z\r\nSUMMARY:alice\r\n"
    b"END:VEVENT\r\nEND:VCALENDAR\r\n"
)


def calendar(url: str, **options: Any) -> CalendarConfig:
    config = parse_config({"calendars": [{"name": "feed", "kind": "ics", "url": url, **options}]})
    return config.calendars[0]


def ics_source(url: str, state: Path | None, **options: Any) -> ICSSource:
    source = open_source(calendar(url, **options), state)
    assert isinstance(source, ICSSource)
    return source


# --- files and folders --------------------------------------------------------------------------


def test_a_file_is_read_again_only_when_it_changes(tmp_path: Path) -> None:
    file = tmp_path / "export.ics"
    file.write_bytes(FEED)
    source = ics_source(str(file), tmp_path / "state")
    first = source.poll()
    assert (dict(first.objects), first.changed, first.bytes_received) == (
        {"export.ics": FEED},
        True,
        len(FEED),
    )
    unchanged = source.poll()
    assert (unchanged.changed, unchanged.bytes_received) == (False, 0)
    changed_text = FEED.replace(b"alice", b"bob")
    file.write_bytes(changed_text)
    os.utime(file, ns=(1, 1))  # a different modification time, whatever the clock
    changed = source.poll()
    assert changed.changed
    assert changed.objects == {"export.ics": changed_text}


def test_a_folder_of_files_keyed_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    (folder / "a.ics").write_bytes(FEED)
    (folder / "B.ICS").write_bytes(FEED.replace(b"f1", b"f2"))
    (folder / ".hidden.ics").write_bytes(b"ignored")
    (folder / "notes.txt").write_bytes(b"ignored")
    (folder / "sub.ics").mkdir()
    source = ics_source(str(folder), None)
    assert set(source.poll().objects) == {"a.ics", "B.ICS"}
    (folder / "a.ics").unlink()
    (folder / "c.ics").write_bytes(FEED.replace(b"f1", b"f3"))
    result = source.poll()
    assert result.changed
    assert set(result.objects) == {"B.ICS", "c.ics"}


def test_an_empty_folder_is_an_empty_calendar(tmp_path: Path) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    (folder / "a.ics").write_bytes(FEED)
    source = ics_source(str(folder), tmp_path / "state")
    assert set(source.poll().objects) == {"a.ics"}
    (folder / "a.ics").unlink()  # every booking deleted: legitimately empty
    result = source.poll()
    assert (dict(result.objects), result.changed) == ({}, True)


HALF_WRITTEN = FEED[: FEED.index(b"END:VEVENT")]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "it is empty"),
        (b" \r\n", "it is empty"),
        (HALF_WRITTEN, "it is incomplete"),
        (b"<!DOCTYPE html><html><body>Log in</body></html>", "it is an HTML or XML page"),
        (b"VERSION:2.0\r\nEND:VCALENDAR\r\n", "it is not iCalendar"),
    ],
)
def test_a_file_that_is_not_a_complete_calendar_keeps_the_snapshot(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    file = tmp_path / "export.ics"
    file.write_bytes(FEED)
    source = ics_source(str(file), tmp_path / "state")
    source.poll()
    file.write_bytes(content)
    os.utime(file, ns=(1, 1))
    with pytest.raises(SourceError, match=f"^calendar feed: {file}: {reason}") as caught:
        source.poll()
    assert "\n" not in str(caught.value)
    assert source.snapshot() == {"export.ics": FEED}
    assert ics_source(str(file), tmp_path / "state").snapshot() == {"export.ics": FEED}


def test_a_byte_order_mark_and_blank_lines_are_fine(tmp_path: Path) -> None:
    file = tmp_path / "export.ics"
    content = b"\xef\xbb\xbf\r\n" + FEED.replace(b"\r\n", b"\n") + b"\n\n"
    file.write_bytes(content)
    assert ics_source(str(file), None).poll().objects == {"export.ics": content}


def test_one_half_written_file_fails_alone_and_keeps_its_last_good_copy(tmp_path: Path) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    (folder / "a.ics").write_bytes(FEED)
    (folder / "b.ics").write_bytes(FEED.replace(b"f1", b"f2"))
    source = ics_source(str(folder), tmp_path / "state")
    good = dict(source.poll().objects)
    # in the same moment: a.ics changes, b.ics is being rewritten, c.ics is new and broken
    changed_a = FEED.replace(b"alice", b"bob")
    (folder / "a.ics").write_bytes(changed_a)
    os.utime(folder / "a.ics", ns=(1, 1))
    (folder / "b.ics").write_bytes(HALF_WRITTEN)
    (folder / "c.ics").write_bytes(b"BEGIN:VCALENDAR\r\n")
    result = source.poll()
    assert result.objects == {"a.ics": changed_a, "b.ics": good["b.ics"]}
    assert sorted(result.problems) == ["b.ics", "c.ics"]
    assert (
        result.problems["b.ics"]
        == f"{folder / 'b.ics'}: it is incomplete (no END:VCALENDAR at its end; being written?)"
    )
    assert ics_source(str(folder), tmp_path / "state").snapshot() == result.objects
    # b.ics is complete again: read at the next poll, not taken as seen
    (folder / "b.ics").write_bytes(FEED.replace(b"f1", b"f3"))
    (folder / "c.ics").unlink()
    result = source.poll()
    assert result.objects == {"a.ics": changed_a, "b.ics": FEED.replace(b"f1", b"f3")}
    assert result.problems == {}


def test_a_missing_file_is_a_clear_error_and_the_snapshot_stays(tmp_path: Path) -> None:
    file = tmp_path / "export.ics"
    file.write_bytes(FEED)
    source = ics_source(str(file), tmp_path / "state")
    source.poll()
    file.unlink()
    with pytest.raises(SourceError, match=f"calendar feed: {file}: no such file or folder"):
        source.poll()
    assert source.snapshot() == {"export.ics": FEED}
    # and a restart finds the snapshot on disk
    assert ics_source(str(file), tmp_path / "state").snapshot() == {"export.ics": FEED}


def test_a_file_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "huge.ics"
    file.write_bytes(FEED * 10)
    source = ICSSource(calendar(str(file)), None, max_bytes=len(FEED))
    with pytest.raises(SourceError, match="is larger than"):
        source.poll()


# --- feeds --------------------------------------------------------------------------------------


@dataclass
class Feed:
    """A real HTTP server for one feed, with ETag and Last-Modified, that counts requests."""

    body: bytes = FEED
    content_type: str = "text/calendar; charset=utf-8"
    etag: str = '"v1"'
    status: int = 200
    password: str | None = None
    requests: list[dict[str, str]] = field(default_factory=list)
    server: Any = None

    def start(self) -> None:
        feed = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                feed.requests.append(dict(self.headers.items()))
                if feed.password is not None:
                    expected = base64.b64encode(f"lab:{feed.password}".encode()).decode()
                    if self.headers.get("Authorization") != f"Basic {expected}":
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", 'Basic realm="feed"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                if feed.status != 200:
                    self.send_response(feed.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("If-None-Match") == feed.etag:
                    self.send_response(304)
                    self.send_header("ETag", feed.etag)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", feed.content_type)
                self.send_header("ETag", feed.etag)
                self.send_header("Last-Modified", "Sun, 01 Nov 2026 10:00:00 GMT")
                self.send_header("Content-Length", str(len(feed.body)))
                self.end_headers()
                self.wfile.write(feed.body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str = "/export/lab.ics?key=s3cret-token") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def feed() -> Iterator[Feed]:
    served = Feed()
    served.start()
    yield served
    served.stop()


def test_a_feed_is_fetched_with_a_conditional_get(feed: Feed, tmp_path: Path) -> None:
    source = ics_source(feed.url(), tmp_path / "state")
    first = source.poll()
    assert (dict(first.objects), first.changed, first.requests) == ({"lab.ics": FEED}, True, 1)
    unchanged = source.poll()
    assert (unchanged.changed, unchanged.requests) == (False, 1)
    assert unchanged.bytes_received < first.bytes_received - len(FEED) + 10
    assert feed.requests[1]["If-None-Match"] == '"v1"'
    assert feed.requests[1]["If-Modified-Since"] == "Sun, 01 Nov 2026 10:00:00 GMT"
    feed.body, feed.etag = FEED.replace(b"alice", b"bob"), '"v2"'
    changed = source.poll()
    assert changed.changed
    assert b"SUMMARY:bob" in changed.objects["lab.ics"]
    # a restart remembers the ETag: the first request is conditional already
    restarted = ics_source(feed.url(), tmp_path / "state")
    assert restarted.snapshot() == changed.objects
    assert restarted.poll().changed is False
    assert feed.requests[-1]["If-None-Match"] == '"v2"'


def test_feed_errors_are_one_line_and_never_show_the_url_key(feed: Feed, tmp_path: Path) -> None:
    feed.status = 404
    source = ics_source(feed.url(), None)
    with pytest.raises(SourceError) as caught:
        source.poll()
    message = str(caught.value)
    assert message == f"calendar feed: {feed.url('/export/…')} answered HTTP 404 Not Found"
    assert "s3cret" not in message
    feed.stop()
    with pytest.raises(SourceError, match=r"cannot fetch .*Connection refused") as down:
        source.poll()
    assert "s3cret" not in str(down.value)
    feed.start()  # for the fixture's clean-up


def test_a_feed_with_basic_authentication(feed: Feed, tmp_path: Path) -> None:
    feed.password = "feed-password"
    password_file = tmp_path / "password"
    password_file.write_text("feed-password\n")
    source = ics_source(feed.url(), None, username="lab", password_file=str(password_file))
    assert source.poll().objects == {"lab.ics": FEED}
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    refused = ics_source(feed.url(), None, username="lab", password_file=str(wrong))
    with pytest.raises(SourceError, match="answered HTTP 401"):
        refused.poll()


def test_a_feed_larger_than_the_limit_is_refused(feed: Feed) -> None:
    feed.body = FEED * 100
    source = ICSSource(calendar(feed.url()), None, max_bytes=len(FEED) * 10)
    with pytest.raises(SourceError, match="sent more than"):
        source.poll()


@pytest.mark.parametrize(
    ("body", "content_type", "reason"),
    [
        (
            b"<!DOCTYPE html>\n<html><body><form>Sign in</form></body></html>",
            "text/html",
            "it is an HTML or XML page",
        ),
        (b"", "text/calendar", "it is empty"),
        (HALF_WRITTEN, "text/calendar", "it is incomplete"),
        (b'{"error": "expired"}', "application/json", "it is not iCalendar"),
    ],
)
def test_a_feed_that_sends_no_calendar_keeps_the_snapshot(
    feed: Feed, tmp_path: Path, body: bytes, content_type: str, reason: str
) -> None:
    source = ics_source(feed.url(), tmp_path / "state")
    source.poll()
    feed.body, feed.content_type, feed.etag = body, content_type, '"v2"'
    with pytest.raises(SourceError) as caught:
        source.poll()
    message = str(caught.value)
    assert message.startswith(f"calendar feed: what {feed.url('/export/…')} sent: {reason}")
    assert "s3cret" not in message and "\n" not in message
    assert source.snapshot() == {"lab.ics": FEED}
    assert ics_source(feed.url(), tmp_path / "state").snapshot() == {"lab.ics": FEED}
    # the feed is fixed: the next request is still conditional on the last good copy
    feed.body, feed.content_type, feed.etag = FEED, "text/calendar", '"v1"'
    assert source.poll().changed is False
    assert feed.requests[-1]["If-None-Match"] == '"v1"'


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://user:pw@cal.example.org:8443/a/b.ics?key=x", "https://cal.example.org:8443/a/…"),
        # Nextcloud's public link: the token is in the path
        (
            "https://cloud.example.org/remote.php/dav/public-calendars/Xq7tokenZ?export",
            "https://cloud.example.org/remote.php/…",
        ),
        (
            "https://cal.example.org/calendar.ics?key=s3cret",
            "https://cal.example.org/calendar.ics?…",
        ),
        ("http://127.0.0.1:5232/alice/0f3a9c/", "http://127.0.0.1:5232/alice/…"),
        ("http://[::1]:5232/alice/", "http://[::1]:5232/alice/"),
        ("https://cal.example.org", "https://cal.example.org"),
    ],
)
def test_shown_url_hides_credentials_query_and_the_path_after_its_first_segment(
    url: str, shown: str
) -> None:
    assert shown_url(url) == shown


def test_a_token_in_the_feed_path_is_never_shown(feed: Feed) -> None:
    url = feed.url("/remote.php/dav/public-calendars/Xq7tokenZ?export")
    feed.status = 403
    source = ics_source(url, None)
    with pytest.raises(SourceError) as refused:
        source.poll()
    feed.stop()
    with pytest.raises(SourceError) as down:
        source.poll()
    feed.start()  # for the fixture's clean-up
    for caught in (refused, down):
        assert "Xq7tokenZ" not in str(caught.value)
        assert "/remote.php/…" in str(caught.value)
