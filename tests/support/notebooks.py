"""Reaching a session's browser tool as its user would: the `ssh -L` line, then HTTP.

The OpenSSH client forwards a local port to the tool's unix socket (or port) in
the session, exactly as the line of the start e-mail does; `http_get` asks
through it, as a browser on the user's computer would.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def ssh_forward(ssh_port: int, login: str, key_file: Path, target: str) -> Iterator[int]:
    """`ssh -N -L <local>:<target>` to the session on 127.0.0.1:`ssh_port` as `login` with
    `key_file`; gives the local port, and ends the client after the block."""
    local = _free_port()
    command = [
        "ssh", "-N", "-F", "/dev/null", "-p", str(ssh_port), "-i", str(key_file),
        "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
        # the tests of host certificates check host keys; here any will do
        "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
        "-o", "LogLevel=ERROR", "-o", "ExitOnForwardFailure=yes",
        "-L", f"127.0.0.1:{local}:{target}", f"{login}@127.0.0.1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        yield local
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, str] | None:
    """GET `path` on localhost:`port` as a browser would (its Host header): the status and
    the Location header ("" without one); None when nothing answers (yet)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path, headers={"Host": f"localhost:{port}"})
        response = connection.getresponse()
        response.read()
        return response.status, response.getheader("Location") or ""
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()
