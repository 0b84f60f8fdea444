"""WebDAV multistatus answers (RFC 4918 §13), read as far as a CalDAV poll needs them.

Given a caldav response whose `tree` is the parsed XML, `responses` yields
each DAV:response's path, status, and what its 200 propstat holds (ETag,
calendar data, whether it is a collection). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple
from urllib.parse import unquote, urljoin, urlsplit

DAV = "{DAV:}"
CALDAV = "{urn:ietf:params:xml:ns:caldav}"


class Entry(NamedTuple):
    """One DAV:response of a multistatus answer, as far as gpuresa reads it."""

    path: str | None
    status: int | None  # the response's own status (404 for a removed member)
    found: bool  # it has a 200 propstat
    etag: str | None
    data: str | None
    collection: bool


def responses(response: Any, base_url: str) -> Iterator[Entry]:
    """Each DAV:response of a multistatus answer, with what its 200 propstat holds; hrefs are
    read as paths against `base_url`."""
    for element in response.tree.iter(f"{DAV}response"):
        href_text = element.findtext(f"{DAV}href")
        found = False
        etag = data = None
        collection = False
        for propstat in element.findall(f"{DAV}propstat"):
            if _status_code(propstat.findtext(f"{DAV}status")) != 200:
                continue
            found = True
            prop = propstat.find(f"{DAV}prop")
            if prop is None:
                continue
            etag_text = prop.findtext(f"{DAV}getetag")
            if etag_text is not None:
                etag = etag_text.strip()
            data_element = prop.find(f"{CALDAV}calendar-data")
            if data_element is not None:
                data = data_element.text or ""
            kind = prop.find(f"{DAV}resourcetype")
            collection = collection or (
                kind is not None and kind.find(f"{DAV}collection") is not None
            )
        yield Entry(
            href_path(base_url, href_text) if href_text else None,
            _status_code(element.findtext(f"{DAV}status")),
            found,
            etag,
            data,
            collection,
        )


def href_path(base_url: str, href: str) -> str:
    """An href as a plain path (absolute URL or not, percent-encoded or not)."""
    return unquote(urlsplit(urljoin(base_url, href.strip())).path).rstrip("/")


def _status_code(line: str | None) -> int | None:
    """`HTTP/1.1 404 Not Found` -> 404."""
    if not line:
        return None
    parts = line.split()
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return None
