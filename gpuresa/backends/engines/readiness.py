"""Waiting for a starting session: until sshd and the FTP server answer, or a container dies."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.lookup import Found, container_name, status
from gpuresa.backends.engines.probes import ftp_greeting, ssh_handshake
from gpuresa.model import Session
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import FTP_ROLE, MAIN_ROLE

# How often readiness is probed while a session starts.
PROBE_INTERVAL = 0.05


def wait_ready(
    session: Session,
    address: str,
    deadline: float,
    starting: Mapping[str, Future[None]],
    find: Callable[[], Found],
) -> None:
    """Wait until sshd completes a key exchange and FTP greets; else `SessionError`.

    Given the session, the address its ports are probed on, a
    `time.monotonic()` deadline, the container starts still under way by
    role (a server is probed once its container's start returned, and a
    start that failed is raised at once), and how to look its containers up
    (to notice one that stopped).
    """
    ssh_ready = ftp_ready = False
    next_check = time.monotonic() + 0.5

    def started(role: str) -> bool:
        future = starting.get(role)
        if future is None:
            return True
        if not future.done():
            return False
        future.result()  # raises what the start raised
        return True

    while True:
        remaining = min(2.0, max(deadline - time.monotonic(), 0.1))
        if not ssh_ready and started(MAIN_ROLE):
            ssh_ready = ssh_handshake(address, session.ssh_port, remaining)
        if not ftp_ready and started(FTP_ROLE):
            ftp_ready = ftp_greeting(address, session.ftp_port, remaining)
        if ssh_ready and ftp_ready:
            return
        if time.monotonic() >= deadline:
            late = " and ".join(
                what
                for what, ready in (("sshd", ssh_ready), ("the FTP server", ftp_ready))
                if not ready
            )
            raise SessionError(f"{late} did not answer within the time allowed")
        if time.monotonic() >= next_check and all(future.done() for future in starting.values()):
            check_still_running(find())
            next_check = time.monotonic() + 0.5
        time.sleep(PROBE_INTERVAL)


def check_still_running(found: Found) -> None:
    """Raise `SessionError` when a container of a starting session has stopped."""
    for role, container in (("main container", found.main), ("FTP sidecar", found.ftp)):
        if status(container) not in ("running", "created"):
            code = (container or {}).get("State", {}).get("ExitCode")
            raise SessionError(f"the {role} stopped (status {status(container)}, exit code {code})")


def log_tails(engine: Engine, found: Found) -> str:
    """The end of each container's log, for the error of a start that failed."""
    parts = []
    for role, container in (("main container", found.main), ("FTP sidecar", found.ftp)):
        if container is None:
            continue
        text = engine.logs(container_name(container), 15).strip()
        if text:
            parts.append(f"\n--- log of the {role}:\n{text}")
    return "".join(parts)
