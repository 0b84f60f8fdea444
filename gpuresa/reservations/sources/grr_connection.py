"""Where a GRR database is and how to reach it: the `url` of a "grr" calendar, PyMySQL.

The `url` is `mysql://HOST[:PORT]/DATABASE` (port 3306 by default); with
`unix_socket` set, the socket is used and HOST and PORT are only shown. The
account is the calendar's `username`, its password read from `password_file`
or `password_credential` like every other source's. Every connection has
connect, read and write timeouts, so a database that accepts and never
answers fails a poll instead of holding it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from gpuresa.config.sections import CalendarConfig, read_secret

if TYPE_CHECKING:
    from pymysql.connections import Connection
    from pymysql.cursors import Cursor

DEFAULT_PORT = 3306
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0
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


def describe(calendar: CalendarConfig) -> str:
    """Where the database is, for messages and the snapshot's origin: no password."""
    address = parse_url(calendar.url)
    where = (
        str(calendar.unix_socket)
        if calendar.unix_socket is not None
        else f"{address.host}:{address.port}"
    )
    return f"mysql://{calendar.username}@{where}/{address.database}"


def connect(calendar: CalendarConfig) -> Connection[Cursor]:
    """A new connection for `calendar` (autocommit: each query sees the latest rows).

    Raises `UserError` for the password file or credential, and PyMySQL's
    `MySQLError` (or `OSError`) when the server cannot be reached or refuses.
    """
    import pymysql

    address = parse_url(calendar.url)
    password = read_secret(
        f"calendars[{calendar.name}]", calendar.password_file, calendar.password_credential
    )
    return pymysql.connect(
        host=address.host,
        port=address.port,
        unix_socket=str(calendar.unix_socket) if calendar.unix_socket is not None else None,
        user=calendar.username,
        password=password or "",
        database=address.database,
        charset="utf8mb4",
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT,
        read_timeout=READ_TIMEOUT,
        write_timeout=READ_TIMEOUT,
    )
