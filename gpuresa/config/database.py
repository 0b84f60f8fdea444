"""Where a GRR database is: the `url` of a "grr" calendar, read into its parts.

`mysql://HOST[:PORT]/DATABASE` (or `mariadb://`), port 3306 by default; the
account never travels in the URL (it is the calendar's `username` and
password file or credential).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

DEFAULT_PORT = 3306
_DATABASE = re.compile(r"[A-Za-z0-9_$-]{1,64}")


@dataclass(frozen=True)
class DatabaseAddress:
    """A GRR database: server, port, database name."""

    host: str
    port: int
    database: str


def parse_url(url: str) -> DatabaseAddress:
    """`mysql://HOST[:PORT]/DATABASE` as its parts; raises `ValueError` with the reason."""
    parts = urlsplit(url)
    if parts.scheme not in ("mysql", "mariadb"):
        raise ValueError(f"a grr calendar needs mysql://HOST[:PORT]/DATABASE, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("no account in the URL: use username and password_file")
    if parts.query or parts.fragment:
        raise ValueError("nothing after the database name ('?' or '#')")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"the port of {url!r} is not a number from 1 to 65535") from None
    database = unquote(parts.path.lstrip("/"))
    if not parts.hostname:
        raise ValueError(f"no database server in {url!r}")
    if not _DATABASE.fullmatch(database):
        raise ValueError(f"no database name (letters, digits, '_', '$', '-') in {url!r}")
    return DatabaseAddress(parts.hostname, port, database)


def url_problem(url: str) -> str | None:
    """Why `url` is no GRR database URL, or None (for the config's checks)."""
    try:
        parse_url(url)
    except ValueError as error:
        return str(error)
    return None
