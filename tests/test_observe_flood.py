"""The observation endpoint under a flood: 1,000 slow or idle connections from a host user.

Each test holds 1,000 real TCP connections to a real server on 127.0.0.1, a
third of them trickling half a request one byte at a time, and checks that
/metrics still answers within a second, that the server's threads stay as
they were, and that the hostile connections are closed.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from gpuresa.observe.server import ObservationServer
from gpuresa.observe.state import Published, build_state

FLOOD = 1000
HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@pytest.fixture(autouse=True)
def enough_files() -> Iterator[None]:
    """Both ends of 1,000 connections live in this process: 2,000 descriptors and more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * FLOOD + 512
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.fail(f"the open-file limit {hard} is below {wanted}; raise it to run this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def served(max_connections: int | None = None, request_timeout: float = 5.0) -> ObservationServer:
    state = build_state(host="gpu1", now=datetime.now(UTC), sessions=[])
    server = ObservationServer(
        "127.0.0.1:0",
        Published(state).current,
        max_connections=max_connections,
        request_timeout=request_timeout,
    )
    server.start()
    return server


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def flood(port: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """(slow, idle): 1,000 connections, one in three sending half a request."""
    slow: list[socket.socket] = []
    idle: list[socket.socket] = []
    for index in range(FLOOD):
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        if index % 3 == 0:
            connection.sendall(HALF_REQUEST)
            slow.append(connection)
        else:
            idle.append(connection)
    return slow, idle


def trickle(slow: list[socket.socket]) -> None:
    """One more byte of each slow request; a connection the server closed is left alone."""
    for connection in slow:
        with contextlib.suppress(OSError):
            connection.send(b"x")


def timed_scrape(port: int) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        assert answer.status == 200
        assert b"gpuresa_" in answer.read()
    return time.monotonic() - started


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server closed `connection` (end of stream or reset), without waiting."""
    try:
        return connection.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def close_all(*groups: list[socket.socket]) -> None:
    for group in groups:
        for connection in group:
            connection.close()


def test_a_thousand_slow_connections_cost_no_thread_and_metrics_answer() -> None:
    before = set(threading.enumerate())
    tasks_before = threads()
    server = served()
    try:
        started = set(threading.enumerate()) - before
        assert [thread.name for thread in started] == ["observation-server"]
        slow, idle = flood(server.port)
        try:
            latencies = []
            for _ in range(6):
                trickle(slow)
                latencies.append(timed_scrape(server.port))
                # no thread but the server's was started (other tests' may have ended)
                assert set(threading.enumerate()) - before <= started
                assert threads() <= tasks_before + 1, f"{threads()} tasks for 1,000 clients"
                time.sleep(0.3)
            assert max(latencies) < 1.0, latencies
            assert server.open_connections <= server.max_connections
        finally:
            close_all(slow, idle)
    finally:
        server.stop()
    assert not any(thread.is_alive() for thread in started)


def test_a_request_never_finished_is_closed_after_the_timeout() -> None:
    """The deadline alone (no cap reached): trickling bytes does not keep a connection."""
    server = served(request_timeout=1.5, max_connections=4 * FLOOD)
    try:
        slow, idle = flood(server.port)
        try:
            deadline = time.monotonic() + 1.5 + 3.0
            while time.monotonic() < deadline and not all(map(closed_by_server, slow + idle)):
                trickle(slow)
                time.sleep(0.2)
            open_ones = [c for c in slow + idle if not closed_by_server(c)]
            assert not open_ones, f"{len(open_ones)} connections still open after the timeout"
            assert server.open_connections == 0
            assert timed_scrape(server.port) < 1.0
        finally:
            close_all(slow, idle)
    finally:
        server.stop()


def test_a_full_table_drops_the_oldest_and_serves_the_scrape() -> None:
    """The cap alone (a deadline that never comes during the test): the oldest go first.

    The table is looked at all through the flood, not only once it has settled:
    a connection dropped must leave the table at once, or each new one counts the
    dropped ones not yet cleaned up and drops live connections it did not need to.
    """
    server = served(request_timeout=600.0, max_connections=100)
    seen: list[int] = []
    flooding = threading.Event()

    def watch() -> None:
        while flooding.is_set():
            seen.append(server.open_connections)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    try:
        flooding.set()
        watcher.start()
        try:
            slow, idle = flood(server.port)
        finally:
            time.sleep(0.5)
            flooding.clear()
            watcher.join()
        try:
            assert max(seen) <= 100, f"{max(seen)} connections in a table of 100"
            assert server.open_connections <= 100
            assert timed_scrape(server.port) < 1.0
            first = (slow + idle)[:50]
            assert all(map(closed_by_server, first)), "the oldest connections are dropped"
        finally:
            close_all(slow, idle)
    finally:
        server.stop()


def test_a_head_too_long_or_a_wrong_method_is_refused() -> None:
    server = served()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as connection:
            with contextlib.suppress(OSError):
                connection.sendall(b"GET / HTTP/1.1\r\nX: " + b"a" * 100_000)
            connection.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert connection.recv(100) == b""
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as connection:
            connection.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert connection.recv(100).startswith(b"HTTP/1.1 405")
    finally:
        server.stop()
