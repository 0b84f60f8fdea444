"""The writing half of the CalDAV gateway: GET, conditional PUT, DELETE, MKCALENDAR, rights.

`gpuresa.writeback` writes each booking's state back through a `CalDAVWriter`,
the one place that writes to a CalDAV server (`caldav.CalDAVSource` reads).
Every request has the calendar's `write_timeout`; a write is conditional:

- `put(href, data, etag)` sends `If-Match: <etag>` (the ETag of the copy the
  new data was made from), or `If-None-Match: *` to create: a server that
  has a newer copy (the user or the booking app edited the event meanwhile)
  answers 412, raised as `WriteConflict`, and nothing is overwritten;
- a 403 on the calendar (the account may not write there) is `WriteRefused`,
  permanent until the config changes; a 401 too (a wrong password); a 403 on
  one object is `ObjectRefused`: that write alone is given up;
- anything else that fails (no answer, a timeout, a 5xx) is `WriteFailed`,
  worth trying again later.

GET reads the object's bytes as the server sent them (the caldav client's
own parsing would turn CRLF into LF, and an unchanged line must stay byte for
byte), through the client's HTTP session and authentication.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit
from xml.sax.saxutils import escape

from gpuresa.config.loading import read_secret
from gpuresa.errors import UserError
from gpuresa.reservations.sources import one_line, shown_url, url_secrets
from gpuresa.reservations.sources.caldav import HREF_SAFE
from gpuresa.reservations.sources.multistatus import DAV, responses

log = logging.getLogger(__name__)

# what a PROPFIND of DAV:current-user-privilege-set must grant to write events
WRITE_PRIVILEGES = frozenset({"write", "write-content", "all"})


class WriteError(Exception):
    """A write-back request failed; the message is one line, without credentials."""


class WriteFailed(WriteError):
    """Worth trying again later: no answer, a timeout, a server error."""


class WriteRefused(WriteError):
    """The server refuses this account the write (HTTP 401 or 403): permanent."""


class ObjectRefused(WriteError):
    """The server refuses this one object (HTTP 403 on it: a private event, a size limit,
    a precondition): that write is given up, the calendar's others go on."""


class WriteConflict(WriteError):
    """The object changed since it was read (HTTP 412): read it again, decide again."""


@dataclass(frozen=True)
class Fetched:
    """A calendar object as the server holds it: its text and its ETag."""

    data: str
    etag: str | None


@dataclass(frozen=True)
class Account:
    """Where to write and as whom (the password is read when the writer connects)."""

    url: str
    username: str | None
    password_file: Path | None
    password_credential: str | None
    auth: str
    verify_tls: bool
    label: str  # for messages and password errors: `calendars[gpu1]`


class CalDAVWriter:
    """Writes into one CalDAV collection (a user's calendar or gpuresa's mirror)."""

    def __init__(self, account: Account, timeout: float) -> None:
        self.account = account
        self.url = account.url if account.url.endswith("/") else account.url + "/"
        self.where = shown_url(self.url)
        self.timeout = timeout
        self._client: Any = None
        parts = urlsplit(self.url)
        self._origin = f"{parts.scheme}://{parts.netloc}"

    def object_url(self, href: str) -> str:
        """The URL of the object at path `href` (as the reader keys objects), or of a name
        inside this collection when `href` has no '/'."""
        if "/" not in href:
            return self.url + quote(href, safe=HREF_SAFE)
        return self._origin + quote(href, safe=HREF_SAFE)

    # --- requests ----------------------------------------------------------------------

    def get(self, href: str) -> Fetched | None:
        """The object at `href`, or None when there is none (404, 410)."""
        client = self._connect()
        response = self._call(
            lambda: client.session.request(
                "GET",
                self.object_url(href),
                auth=client.auth,
                timeout=self.timeout,
                verify=self.account.verify_tls,
            )
        )
        status = response.status_code
        if status in (404, 410):
            return None
        self._raise_for(status, response.reason, "reading", one_object=True)
        return Fetched(response.content.decode("utf-8", "replace"), response.headers.get("ETag"))

    def find(self, uid: str) -> list[str]:
        """The paths of the objects whose event UID holds `uid` (a calendar-query REPORT:
        CalDAV's text-match finds UIDs that contain it; the caller checks which is equal)."""
        client = self._connect()
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            '<c:calendar-query xmlns:d="DAV:" xmlns:c="urn:ietf:params:xml:ns:caldav">'
            "<d:prop><d:getetag/></d:prop><c:filter>"
            '<c:comp-filter name="VCALENDAR"><c:comp-filter name="VEVENT">'
            '<c:prop-filter name="UID">'
            f'<c:text-match collation="i;octet">{escape(uid)}</c:text-match>'
            "</c:prop-filter></c:comp-filter></c:comp-filter></c:filter></c:calendar-query>"
        )
        response = self._call(lambda: client.report(self.url, body, depth=1))
        self._raise_for(response.status, response.reason, "searching")
        if response.tree is None:
            return []
        return [
            entry.path
            for entry in responses(response, self.url)
            if entry.path is not None and entry.found and not entry.collection
        ]

    def put(self, href: str, data: str, etag: str | None) -> str | None:
        """Write `data` at `href` if the server still holds the copy of ETag `etag` (None:
        only if there is no object there yet); returns the new ETag when the server says.
        """
        client = self._connect()
        headers = {"Content-Type": "text/calendar; charset=utf-8"}
        if etag is None:
            headers["If-None-Match"] = "*"
        else:
            headers["If-Match"] = etag
        response = self._call(
            lambda: client.put(self.object_url(href), data, headers), one_object=True
        )
        self._raise_for(response.status, response.reason, "writing", one_object=True)
        found = response.headers.get("ETag")
        return str(found) if found else None

    def delete(self, href: str) -> None:
        """Remove the object at `href`; one already gone is no error."""
        client = self._connect()
        response = self._call(lambda: client.delete(self.object_url(href)), one_object=True)
        if response.status in (404, 410):
            return
        self._raise_for(response.status, response.reason, "removing", one_object=True)

    def ensure_collection(self) -> None:
        """Make the collection (MKCALENDAR) if the server has none at the URL."""
        client = self._connect()
        body = '<?xml version="1.0" encoding="utf-8"?><d:propfind xmlns:d="DAV:"><d:prop>'
        body += "<d:resourcetype/></d:prop></d:propfind>"
        response = self._call(lambda: client.propfind(self.url, body, depth=0))
        if response.status == 404:
            made = self._call(lambda: client.mkcalendar(self.url))
            self._raise_for(made.status, made.reason, "making the calendar")
            log.info("%s: made the calendar %s", self.account.label, self.where)
            return
        self._raise_for(response.status, response.reason, "reading the calendar")

    def write_problem(self) -> str | None:
        """Why this account cannot write events here (from DAV:current-user-privilege-set),
        or None when it can (or the server does not say); raises `WriteFailed` when the
        server does not answer."""
        client = self._connect()
        body = (
            '<?xml version="1.0" encoding="utf-8"?><d:propfind xmlns:d="DAV:"><d:prop>'
            "<d:current-user-privilege-set/></d:prop></d:propfind>"
        )
        try:
            response = self._call(lambda: client.propfind(self.url, body, depth=0))
            self._raise_for(response.status, response.reason, "reading the rights on")
        except WriteRefused as error:
            return str(error)
        if response.tree is None:
            return None
        granted: set[str] = set()
        found = False
        for element in response.tree.iter(f"{DAV}current-user-privilege-set"):
            found = True
            for privilege in element.iter(f"{DAV}privilege"):
                granted.update(child.tag.rsplit("}", 1)[-1] for child in privilege)
        if not found or granted & WRITE_PRIVILEGES:
            return None
        return (
            f"the account {self.account.username or '(none)'} may not write into "
            f"{self.where} (it has {', '.join(sorted(granted)) or 'no rights'})"
        )

    # --- the connection ----------------------------------------------------------------

    def _connect(self) -> Any:
        if self._client is None:
            from caldav.davclient import DAVClient

            account = self.account
            password = None
            if account.username is not None:
                try:
                    password = read_secret(
                        account.label, account.password_file, account.password_credential
                    )
                except UserError as error:
                    raise WriteRefused(str(error)) from None
            self._client = DAVClient(
                url=self.url,
                username=account.username,
                password=password,
                auth_type=account.auth if account.username is not None else None,
                ssl_verify_cert=account.verify_tls,
                timeout=max(1, round(self.timeout)),
                enable_rfc6764=False,
            )
        return self._client

    def _call(self, request: Any, one_object: bool = False) -> Any:
        """Run `request()`; a refused login or write is `WriteRefused` (a 403 on
        `one_object`: `ObjectRefused`), any other failure of the server side `WriteFailed`."""
        from caldav.lib import error as caldav_error

        try:
            return request()
        except caldav_error.AuthorizationError as error:
            status = getattr(error, "status", None) or 403
            if one_object and str(status) == "403":
                raise ObjectRefused(f"{self.where}: this object refused (HTTP 403)") from None
            raise WriteRefused(
                f"{self.where} refused the account {self.account.username or '(none)'} "
                f"(HTTP {status})"
            ) from None
        except Exception as error:  # network, TLS, timeout, XML...
            raise WriteFailed(
                f"no answer from {self.where}: {one_line(error, url_secrets(self.url))}"
            ) from None

    def _raise_for(
        self, status: int | None, reason: str | None, doing: str, one_object: bool = False
    ) -> None:
        """Map an answer's status: 412 `WriteConflict`; 401, or 403 on the collection,
        `WriteRefused` (the account's rights); 403 on `one_object`, `ObjectRefused` (a
        calendar writer can make one event refused: that turns nothing off)."""
        if status is not None and 200 <= status < 300:
            return
        what = f"HTTP {status} {reason or ''}".rstrip()
        if status == 412:
            raise WriteConflict(f"{doing} {self.where}: the object changed meanwhile ({what})")
        if status == 403 and one_object:
            raise ObjectRefused(f"{doing} {self.where}: this object refused ({what})")
        if status in (401, 403):
            raise WriteRefused(f"{doing} {self.where}: refused ({what})")
        raise WriteFailed(f"{doing} {self.where} failed ({what})")
