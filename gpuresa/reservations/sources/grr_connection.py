"""Where a GRR database is and how to reach it: the `url` of a "grr" calendar, PyMySQL.

The `url` is `mysql://HOST[:PORT]/DATABASE` (port 3306 by default); with
`unix_socket` set, the socket is used and HOST and PORT are only shown. The
account is the calendar's `username`, its password read from `password_file`
or `password_credential` like every other source's.

A poll has one deadline, `POLL_DEADLINE`, for the connection, the login and
the queries together. PyMySQL's own timeouts hold per socket operation, and
its connect timeout only for the TCP connect (the server's greeting is then
awaited for the read timeout): a server that accepts and never answers, or
answers a byte at a time, would hold a poll for several of them. At the
deadline a timer shuts the socket down, and whatever read or write is
blocked returns at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.database import parse_url
from gpuresa.config.loading import read_secret

if TYPE_CHECKING:
    from pymysql.connections import Connection
    from pymysql.cursors import Cursor

# seconds one poll may take, connection, login and queries together
POLL_DEADLINE = 10.0


# how much earlier than asked a socket timeout may fire (its poll() counts milliseconds)
TIMEOUT_GRANULARITY = 0.01


class Deadline:
    """One poll's deadline: past it, the watched socket is shut down (see the module)."""

    def __init__(self, seconds: float = POLL_DEADLINE) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._socket: socket.socket | None = None
        self._over = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def remaining(self) -> float:
        """Seconds left (a little above 0 once past: socket timeouts must be positive)."""
        return max(0.001, self.end - time.monotonic())

    def passed(self) -> bool:
        """Whether the deadline is over: its timer fired, or a socket timeout set to the time
        left did first (a loaded machine runs the timer's thread late)."""
        return self.expired or time.monotonic() >= self.end - TIMEOUT_GRANULARITY

    def watch(self, connection_socket: socket.socket) -> None:
        """Shut `connection_socket` down at the deadline (at once if it has passed)."""
        with self._lock:
            self._socket = connection_socket
            if self.expired:
                _shut(connection_socket)

    def _expire(self) -> None:
        with self._lock:
            if self._over:
                return  # the poll ended meanwhile: its connection is kept for the next one
            self.expired = True
            if self._socket is not None:
                _shut(self._socket)

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with self._lock:
            self._over = True
        self._timer.cancel()


def _shut(connection_socket: socket.socket) -> None:
    # already closed or never connected: nothing is blocked on it
    with contextlib.suppress(OSError):
        connection_socket.shutdown(socket.SHUT_RDWR)


def describe(calendar: CalendarConfig) -> str:
    """Where the database is, for messages and the snapshot's origin: no password."""
    address = parse_url(calendar.url)
    where = (
        str(calendar.unix_socket)
        if calendar.unix_socket is not None
        else f"{address.host}:{address.port}"
    )
    return f"mysql://{calendar.username}@{where}/{address.database}"


def connect(
    calendar: CalendarConfig, deadline: Deadline
) -> tuple[Connection[Cursor], socket.socket]:
    """A new connection for `calendar` (autocommit: each query sees the latest rows), and its
    socket, made and logged in within `deadline` (which watches the socket).

    Raises `UserError` for the password file or credential, and PyMySQL's
    `MySQLError` (or `OSError`) when the server cannot be reached, refuses,
    or does not answer in time.
    """
    from pymysql.connections import Connection

    address = parse_url(calendar.url)
    password = read_secret(
        f"calendars[{calendar.name}]", calendar.password_file, calendar.password_credential
    )
    if calendar.unix_socket is not None:
        connection_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline.watch(connection_socket)
        connection_socket.settimeout(deadline.remaining())
        try:
            connection_socket.connect(str(calendar.unix_socket))
        except OSError:
            connection_socket.close()
            raise
    else:
        connection_socket = socket.create_connection(
            (address.host, address.port), deadline.remaining()
        )
        deadline.watch(connection_socket)
        connection_socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection_socket.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # the per-operation timeouts only back the deadline up
    connection: Connection[Cursor] = Connection(
        host=address.host,
        port=address.port,
        user=calendar.username,
        password=password or "",
        database=address.database,
        charset="utf8mb4",
        autocommit=True,
        read_timeout=deadline.seconds,
        write_timeout=deadline.seconds,
        defer_connect=True,
    )
    connection.connect(connection_socket)
    return connection, connection_socket
