"""The observation endpoint: `/metrics` for Prometheus and `/` for the status page.

Any host user can connect to it, so a client may be hostile: it may open
thousands of connections, send half a request one byte a minute, or never
read the answer. The server therefore runs one asyncio loop on one daemon
thread, whatever the number of connections (a thread per connection, as
`ThreadingHTTPServer` does, lets such clients hold threads until the unit's
task limit stops the daemon from starting the threads of its actions), and
bounds every connection:

- a request must arrive whole within `REQUEST_TIMEOUT` and its head must fit
  in `HEAD_LIMIT` bytes; the answer must be taken within `WRITE_TIMEOUT`;
  the connection is then closed (no keep-alive: one request per connection);
- at most `max_connections` are open at once: one more closes the oldest
  that has not finished its request, so a scrape that arrives while the
  table is full is served and the slowest client is dropped.

Why not a server library: aiohttp and uvicorn (the well-kept asyncio HTTP
servers) keep a connection whose request is never finished: their keep-alive
timer starts again on each byte received, so the deadline on receiving a
request would have to be added here anyway, and for two read-only GET pages
that is nearly all the code. The request line is all that is read of a
request; its headers are skipped.

Each request reads the published state (never Docker, NVML or the journal),
and `stop()` returns within a second. Read-only: GET and HEAD only.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
from collections.abc import Callable
from datetime import UTC, tzinfo
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuresa.observe.metrics import registry_for
from gpuresa.observe.page import render_page
from gpuresa.observe.state import ObservedState

log = logging.getLogger(__name__)

# no script may run on the page, whatever a calendar managed to put in it
_PAGE_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
# a whole request (line and headers) must arrive within this many seconds
REQUEST_TIMEOUT = 5.0
# and the answer be read within this many
WRITE_TIMEOUT = 10.0
# the longest request head read; browsers send about 1 KiB
HEAD_LIMIT = 16 * 1024
# connections open at once, at most; also at most a quarter of the open-file limit
MAX_CONNECTIONS = 512


def parse_address(address: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464" ("[::1]:9464" for IPv6)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connection_cap() -> int:
    """How many connections may be open at once: `MAX_CONNECTIONS`, or a quarter of
    the process's open-file limit when that is less (the daemon needs the rest)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft // 4))


class ObservationServer:
    """Serves `provider()`'s state at `address` ("host:port"; port 0 picks a free one).

    Given the address, a function returning the published state, the page's
    time zone and how many days its timeline shows; `max_connections` caps
    the connections open at once (`connection_cap()` when None), and
    `request_timeout` is how long a client has to send its whole request.
    """

    def __init__(
        self,
        address: str,
        provider: Callable[[], ObservedState],
        zone: tzinfo = UTC,
        days: int = 3,
        *,
        max_connections: int | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.listen = address
        self.address = parse_address(address)
        self.provider = provider
        self.zone = zone
        self.days = days
        self.max_connections = max_connections or connection_cap()
        self.request_timeout = request_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        # connections still receiving their request, oldest first (dicts keep order)
        self._receiving: dict[asyncio.StreamWriter, None] = {}
        # every connection open now
        self._writers: set[asyncio.StreamWriter] = set()
        self._registry = registry_for(provider)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the observation server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def open_connections(self) -> int:
        """How many connections are open now."""
        return len(self._writers)

    def start(self) -> None:
        """Listen and serve on a daemon thread. Raises `OSError` when the address is taken."""
        loop = asyncio.new_event_loop()
        try:
            host, port = self.address
            self._server = loop.run_until_complete(
                asyncio.start_server(
                    self._connection, host, port, limit=HEAD_LIMIT, backlog=256, reuse_address=True
                )
            )
        except BaseException:
            loop.close()
            raise
        self._loop = loop
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="observation-server", daemon=True
        )
        self._thread.start()
        log.info("metrics and status page on http://%s:%s/", self.address[0], self.port)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            # stopped: end every connection by closing it (a cancelled stream task
            # makes asyncio log an error), then let their tasks finish
            for writer in list(self._writers):
                writer.transport.abort()
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=2))
        finally:
            loop.close()

    def stop(self) -> None:
        """Stop listening and close every connection; idempotent."""
        loop, server, self._loop, self._server = self._loop, self._server, None, None
        if loop is not None and server is not None and not loop.is_closed():
            loop.call_soon_threadsafe(server.close)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # --- one connection ---------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= self.max_connections:
            # the table is full: drop the oldest connection that is still receiving, or
            # this one when every other is being answered. The one dropped leaves the
            # table now, not when its task next runs: under a flood that is many accepts
            # later, and each of them would count it and drop one more live connection
            if not self._receiving:
                writer.transport.abort()
                return
            oldest = next(iter(self._receiving))
            self._receiving.pop(oldest)
            self._writers.discard(oldest)
            oldest.transport.abort()
        self._writers.add(writer)
        self._receiving[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.request_timeout)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                # too slow, gone before the end of its request, or too long
                return
            finally:
                self._receiving.pop(writer, None)
            # drain() then returns only once the whole answer is with the kernel
            writer.transport.set_write_buffer_limits(high=0)
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (OSError, TimeoutError):
            pass
        finally:
            self._writers.discard(writer)
            # nothing is left to send (or the client would not take it): close at once
            writer.transport.abort()

    def _answer(self, head: bytes) -> bytes:
        """The whole HTTP answer to a request whose head is `head`."""
        method, path = _request_line(head)
        if method not in ("GET", "HEAD"):
            return _response(HTTPStatus.METHOD_NOT_ALLOWED, b"", "text/plain", method == "HEAD")
        if path == "/metrics":
            body, kind = generate_latest(self._registry), CONTENT_TYPE_LATEST
        elif path == "/":
            page = render_page(self.provider(), self.zone, self.days)
            body, kind = page.encode("utf-8"), "text/html; charset=utf-8"
        else:
            return _response(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", method == "HEAD")
        log.debug("%s %s", method, path)
        return _response(HTTPStatus.OK, body, kind, method == "HEAD")


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path without its query) of a request head; ("", "") when unreadable."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return "", ""
    return parts[0], parts[1].split("?", 1)[0]


def _response(status: HTTPStatus, body: bytes, kind: str, head_only: bool) -> bytes:
    headers = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        "Server: gpuresa",
        f"Content-Type: {kind}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        "X-Content-Type-Options: nosniff",
        f"Content-Security-Policy: {_PAGE_POLICY}",
        "Connection: close",
    ]
    if status == HTTPStatus.METHOD_NOT_ALLOWED:
        headers.append("Allow: GET, HEAD")
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)
