"""The observation endpoint: `/metrics` for Prometheus and `/` for the status page.

A `ThreadingHTTPServer` in a daemon thread: each request reads the published
state (never Docker, NVML or the journal), so a slow client delays nothing
but itself, and `stop()` returns at once. Read-only: GET and HEAD only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, tzinfo
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuresa.observe.metrics import registry_for
from gpuresa.observe.page import render_page
from gpuresa.observe.state import ObservedState

log = logging.getLogger(__name__)

# no script may run on the page, whatever a calendar managed to put in it
_PAGE_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"


def parse_address(address: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464" ("[::1]:9464" for IPv6)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class ObservationServer:
    """Serves `provider()`'s state at `address` ("host:port"; port 0 picks a free one)."""

    def __init__(
        self,
        address: str,
        provider: Callable[[], ObservedState],
        zone: tzinfo = UTC,
        days: int = 3,
    ) -> None:
        self.listen = address
        self.address = parse_address(address)
        self.provider = provider
        self.zone = zone
        self.days = days
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the observation server is not started")
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Listen and serve in a daemon thread. Raises `OSError` when the address is taken."""
        registry = registry_for(self.provider)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "gpuresa"
            sys_version = ""

            def do_GET(self) -> None:
                self._answer(send_body=True)

            def do_HEAD(self) -> None:
                self._answer(send_body=False)

            def _answer(self, send_body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, kind = generate_latest(registry), CONTENT_TYPE_LATEST
                elif path == "/":
                    page = render_page(owner.provider(), owner.zone, owner.days)
                    body, kind = page.encode("utf-8"), "text/html; charset=utf-8"
                else:
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", _PAGE_POLICY)
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("%s " + format, self.address_string(), *args)

        self._server = ThreadingHTTPServer(self.address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="observation-server", daemon=True
        )
        self._thread.start()
        log.info("metrics and status page on http://%s:%s/", self.address[0], self.port)

    def stop(self) -> None:
        """Stop listening; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
