"""Where a GRR database is and how to reach it: the `url` of a "grr" calendar, PyMySQL.

The `url` is `mysql://HOST[:PORT]/DATABASE` (port 3306 by default); with
`unix_socket` set, the socket is used and HOST and PORT are only shown. The
account is the calendar's `username`, its password read from `password_file`
or `password_credential` like every other source's. Every connection has
connect, read and write timeouts, so a database that accepts and never
answers fails a poll instead of holding it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.database import parse_url
from gpuresa.config.loading import read_secret

if TYPE_CHECKING:
    from pymysql.connections import Connection
    from pymysql.cursors import Cursor

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0


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
