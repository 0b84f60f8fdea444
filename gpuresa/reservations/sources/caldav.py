"""The one gateway to CalDAV servers: incremental, cheap polls with the `caldav` client.

A poll asks for as little as the server allows:

1. With a sync token (RFC 6578), one `sync-collection` REPORT: an unchanged
   calendar costs that one small request; a changed one names the changed
   and removed objects, and one `calendar-multiget` REPORT fetches the
   changed ones.
2. When the server refuses or has expired the token (Radicale answers 403
   `valid-sync-token`, others 409 or 412), or on the first poll, a listing of
   every object with its ETag: a `sync-collection` without a token (which
   also yields a new token) or, on servers without RFC 6578, a Depth 1
   PROPFIND. Listed ETags are compared with the snapshot; only new or changed
   objects are fetched, those no longer listed are dropped. Objects are keyed
   by their path, so nothing is lost or counted twice across the fallback.

`caldav.DAVClient` does the HTTP, the authentication (basic or digest) and
the XML parsing; requests and bytes received are counted by a hook on its
session. The last good snapshot is kept on disk (see `snapshot`); an answer
that is not a multistatus (an HTML login page) fails the poll and leaves it
as it was. One object that cannot be fetched (the server answers an error
for it, or data that is not a complete VCALENDAR) fails alone: it is named in
the poll's `problems`, its last good copy stays (a flaky fetch cancels no
booking; only a listing that no longer has it, or a 404, removes it), the
sync token is not advanced past it, so it is fetched again at the next poll.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit
from xml.sax.saxutils import escape

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.loading import read_secret
from gpuresa.errors import UserError
from gpuresa.ical.state_block import without_own_part
from gpuresa.reservations.sources import (
    PollResult,
    SourceError,
    icalendar_problem,
    one_line,
    shown_url,
    url_secrets,
)
from gpuresa.reservations.sources.multistatus import DAV, responses
from gpuresa.reservations.sources.snapshot import Changes, Snapshot, SnapshotStore, StoredObject

log = logging.getLogger(__name__)

MULTIGET_BATCH = 200
MAX_SYNC_PAGES = 50
HREF_SAFE = "/@:~!$&'()*+,;="


class _TokenRefused(Exception):
    """The server will not sync from this token (expired, unknown, or no RFC 6578)."""


@dataclass(frozen=True)
class _Changes:
    """What a sync or a listing says: objects to (re)consider by ETag, and removed ones."""

    etags: dict[str, str | None]
    removed: set[str]
    token: str | None
    complete: bool  # a full listing: anything not in `etags` is gone


class CalDAVSource:
    """One CalDAV calendar collection, polled incrementally; see the module's docstring."""

    def __init__(
        self,
        calendar: CalendarConfig,
        state_dir: Path | None,
        *,
        persist: bool = True,
        timeout: float = 30.0,
    ) -> None:
        self.name = calendar.name
        self.calendar = calendar
        self.url = calendar.url if calendar.url.endswith("/") else calendar.url + "/"
        self.collection_path = unquote(urlsplit(self.url).path).rstrip("/")
        self.where = shown_url(self.url)  # for messages: no credentials, no query
        directory = state_dir / "calendars" / calendar.name if state_dir is not None else None
        self.store = SnapshotStore(directory, persist=persist)
        self.state: Snapshot = self.store.load(self.url)
        self.last_success: datetime | None = (
            self.store.load_success() if self.state.objects else None
        )
        self.timeout = timeout
        self._client: Any = None
        self.requests = 0
        self.bytes_received = 0
        self.last_changes = Changes()
        # the objects that could not be fetched at the last poll: why
        self.problems: dict[str, str] = {}

    # --- the interface -----------------------------------------------------------------

    def snapshot(self) -> Mapping[str, bytes]:
        """The objects of the last successful poll, or of the snapshot loaded from disk."""
        return {href: stored.data for href, stored in self.state.objects.items()}

    def poll(self, now: datetime | None = None) -> PollResult:
        """Bring the snapshot up to date with the server; raises `SourceError` on failure.

        `now` is recorded as the time of this success (default: the clock).
        """
        from caldav.lib import error as caldav_error

        self.requests = self.bytes_received = 0
        try:
            changed = self._poll()
        except SourceError:
            raise
        except caldav_error.AuthorizationError as error:
            status = getattr(error, "status", None) or "401/403"
            raise SourceError(
                f"calendar {self.name}: the server refused access to {self.where} "
                f"(HTTP {status}); check username and password"
            ) from None
        except UserError as error:  # the password file or credential
            raise SourceError(f"calendar {self.name}: {error}") from None
        except Exception as error:  # network, TLS, XML, ...: any failure of the server side
            log.debug("calendar %s: poll failed", self.name, exc_info=True)
            raise SourceError(
                f"calendar {self.name}: cannot read {self.where}: "
                f"{one_line(error, url_secrets(self.url))}"
            ) from None
        now = now or datetime.now(UTC)
        self.last_success = now
        self.store.save_success(now)
        return PollResult(
            self.snapshot(), changed, self.requests, self.bytes_received, dict(self.problems)
        )

    # --- one poll ------------------------------------------------------------------------

    def _poll(self) -> bool:
        client = self._connect()
        state = self.state
        changes: _Changes | None = None
        if state.sync_token and state.sync_supported is not False:
            try:
                changes = self._sync(client, state.sync_token)
            except _TokenRefused as refusal:
                log.info(
                    "calendar %s: the server refused the sync token (%s); comparing a listing",
                    self.name,
                    refusal,
                )
        if changes is None:
            changes = self._list(client)
        objects = dict(state.objects)
        removed = {href for href in changes.removed if href in objects}
        if changes.complete:
            removed |= {href for href in objects if href not in changes.etags}
        wanted = [
            href
            for href, etag in changes.etags.items()
            if href not in objects or etag is None or objects[href].etag != etag
        ]
        fetched, problems = self._fetch(client, wanted) if wanted else ({}, {})
        added: set[str] = set()
        modified: set[str] = set()
        for href in removed:
            del objects[href]
        for href in wanted:
            found = fetched.get(href)
            if href in problems:
                continue  # not fetched this time: its last good copy, if any, stays
            if found is None:
                # listed, then gone before it could be fetched (the server said 404)
                if objects.pop(href, None) is not None:
                    removed.add(href)
            elif href not in objects:
                objects[href] = found
                added.add(href)
            elif objects[href].data != found.data and without_own_part(
                objects[href].data
            ) != without_own_part(found.data):
                objects[href] = found
                modified.add(href)
            else:
                # same data, new ETag; or only gpuresa's own written state changed
                # (`gpuresa.ical.state_block`): not a change of the booking
                objects[href] = found
        self.last_changes = Changes(frozenset(added), frozenset(modified), frozenset(removed))
        changed = bool(added or modified or removed)
        token = changes.token
        if problems:
            # the next sync must name the objects that failed again
            token = None if changes.complete else state.sync_token
        token_changed = token != state.sync_token
        self.problems = problems
        state.objects = objects
        state.sync_token = token
        if changed or token_changed or wanted:
            self.store.save(state)
        log.debug(
            "calendar %s: %d object(s), %d fetched, %d removed, %d request(s), %d bytes",
            self.name,
            len(objects),
            len(fetched),
            len(removed),
            self.requests,
            self.bytes_received,
        )
        return changed

    def _connect(self) -> Any:
        """The DAV client, made once; it keeps its HTTP connection between polls."""
        if self._client is None:
            from caldav.davclient import DAVClient

            password = None
            if self.calendar.username is not None:
                password = read_secret(
                    f"calendars[{self.name}]",
                    self.calendar.password_file,
                    self.calendar.password_credential,
                )
            client = DAVClient(
                url=self.url,
                username=self.calendar.username,
                password=password,
                auth_type=self.calendar.auth if self.calendar.username is not None else None,
                ssl_verify_cert=self.calendar.verify_tls,
                timeout=int(self.timeout),
                enable_rfc6764=False,
            )
            client.session.hooks["response"].append(self._count)
            self._client = client
        return self._client

    def _count(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        """Session hook: count each response and its bytes (headers and body)."""
        self.requests += 1
        headers = sum(len(name) + len(value) + 4 for name, value in response.headers.items())
        self.bytes_received += headers + len(response.content or b"") + 17
        return response

    # --- the three requests ------------------------------------------------------------

    def _sync(self, client: Any, token: str) -> _Changes:
        """Changes since `token`: one sync-collection REPORT (more if the server pages)."""
        etags: dict[str, str | None] = {}
        removed: set[str] = set()
        for _ in range(MAX_SYNC_PAGES):
            response = self._report_sync(client, token)
            token_found, truncated = None, False
            for entry in responses(response, self.url):
                if entry.path is None:
                    continue
                if entry.path == self.collection_path:
                    # RFC 6578 3.6: 507 on the collection itself means "more to come"
                    truncated = truncated or entry.status == 507
                    continue
                if entry.status == 404 and not entry.found:
                    removed.add(entry.path)
                    etags.pop(entry.path, None)
                elif entry.found:
                    etags[entry.path] = entry.etag
                    removed.discard(entry.path)
            token_found = response.tree.findtext(f"{DAV}sync-token")
            if not token_found:
                raise _TokenRefused("the server sent no new sync token")
            if not truncated or token_found == token:
                return _Changes(etags, removed, token_found, complete=False)
            token = token_found  # a truncated answer: ask again from where it stopped
        raise _TokenRefused(f"the server paged the changes more than {MAX_SYNC_PAGES} times")

    def _report_sync(self, client: Any, token: str) -> Any:
        """The sync-collection REPORT; raises `_TokenRefused` when the server will not (a
        401 is raised as the authentication failure it is)."""
        from caldav.lib import error as caldav_error

        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            '<d:sync-collection xmlns:d="DAV:">'
            f"<d:sync-token>{escape(token)}</d:sync-token>"
            "<d:sync-level>1</d:sync-level>"
            "<d:prop><d:getetag/></d:prop>"
            "</d:sync-collection>"
        )
        try:
            response = client.report(self.url, body, depth=0)
        except caldav_error.AuthorizationError as error:
            status = getattr(error, "status", None)
            if status == 401:
                raise
            # RFC 6578: 403 with DAV:valid-sync-token for an unknown or expired token
            raise _TokenRefused(f"HTTP {status or 403}") from None
        if response.status != 207 or response.tree is None:
            raise _TokenRefused(f"HTTP {response.status} {response.reason or ''}".rstrip())
        return response

    def _list(self, client: Any) -> _Changes:
        """Every object with its ETag: sync-collection from scratch, else a PROPFIND."""
        if self.state.sync_supported is not False:
            try:
                changes = self._sync(client, "")
            except _TokenRefused as refusal:
                log.info(
                    "calendar %s: no sync-collection here (%s); listing with PROPFIND",
                    self.name,
                    refusal,
                )
            else:
                self.state.sync_supported = True
                return _Changes(changes.etags, set(), changes.token, complete=True)
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            '<d:propfind xmlns:d="DAV:"><d:prop><d:getetag/><d:resourcetype/></d:prop>'
            "</d:propfind>"
        )
        response = client.propfind(self.url, body, depth=1)
        if response.status != 207 or response.tree is None:
            # a 200 is not a WebDAV answer at all: most often a login page
            what = ", not a WebDAV answer" if 200 <= (response.status or 0) < 300 else ""
            raise SourceError(
                f"calendar {self.name}: listing {self.where} failed "
                f"(HTTP {response.status} {response.reason}{what})"
            )
        # remembered only now: a login page refuses sync-collection too
        self.state.sync_supported = False
        etags: dict[str, str | None] = {}
        for entry in responses(response, self.url):
            if entry.path is None or entry.path == self.collection_path or not entry.found:
                continue
            if not entry.collection:
                etags[entry.path] = entry.etag
        return _Changes(etags, set(), None, complete=True)

    def _fetch(
        self, client: Any, hrefs: list[str]
    ) -> tuple[dict[str, StoredObject], dict[str, str]]:
        """The data and ETags of `hrefs` (calendar-multiget REPORTs, in batches), and why
        each that could not be fetched failed.

        An href the server answers 404 for is in neither (it is gone). A batch
        the server refuses as a whole is asked again one object at a time, so
        one object the server cannot send fails alone.
        """
        found: dict[str, StoredObject] = {}
        problems: dict[str, str] = {}
        batches = [
            hrefs[first : first + MULTIGET_BATCH] for first in range(0, len(hrefs), MULTIGET_BATCH)
        ]
        while batches:
            batch = batches.pop()
            response = self._multiget(client, batch)
            if response.status != 207 or response.tree is None:
                if len(batch) > 1:
                    batches.extend([href] for href in batch)
                    continue
                problems[batch[0]] = f"HTTP {response.status} {response.reason or ''}".rstrip()
                continue
            answered: set[str] = set()
            for entry in responses(response, self.url):
                if entry.path is None or entry.path not in batch:
                    continue
                answered.add(entry.path)
                if entry.data is None:
                    if entry.status != 404:  # a 404: gone since the listing
                        status = f"HTTP {entry.status}" if entry.status else "no calendar data"
                        problems[entry.path] = f"the server sent no data for it ({status})"
                    continue
                data = entry.data.encode("utf-8")
                problem = icalendar_problem(data)
                if problem is not None:
                    # a broken answer must not read as a booking removed
                    problems[entry.path] = problem
                    continue
                found[entry.path] = StoredObject(data, entry.etag)
            for href in batch:
                if href not in answered:
                    problems[href] = "the server's answer did not include it"
        for href, problem in list(problems.items()):
            # the object's name, as the other messages give it: the path may be private
            problems[href] = f"object {href.rsplit('/', 1)[-1]} from {self.where}: {problem}"
            log.warning("calendar %s: %s; its last good copy (if any) stays", self.name, problem)
        return found, problems

    def _multiget(self, client: Any, batch: list[str]) -> Any:
        listed = "".join(
            f"<d:href>{escape(quote(href, safe=HREF_SAFE))}</d:href>" for href in batch
        )
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            '<c:calendar-multiget xmlns:d="DAV:" xmlns:c="urn:ietf:params:xml:ns:caldav">'
            "<d:prop><d:getetag/><c:calendar-data/></d:prop>"
            f"{listed}</c:calendar-multiget>"
        )
        return client.report(self.url, body, depth=1)
