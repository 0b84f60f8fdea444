"""Whether a session's job serves SSH on its port: the job's own sshd, by its host key.

The job's sshd runs as the booking's login, so the session's port on the node
is an unprivileged one, which any process on the node may hold first. What
proves the session is the host key the job made in its run folder (the
login's, which no other user may write): gpuresa waits for an SSH server on
the port that presents that key, and tells the user its fingerprint. A
server that presents another key holds the port instead of the job's: the
start fails with that reason, and gpuresa never calls it the session.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import time
from pathlib import Path

import paramiko

from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.host_keys import fingerprint_in

POLL = 0.2


def presented_digest(address: str, port: int, timeout: float = 5) -> str | None:
    """The SHA-256 digest (base64, as `ssh` shows it after "SHA256:") of the host key the
    SSH server on `address:port` presents; None when none answers there yet."""
    try:
        link = socket.create_connection((address, port), timeout=timeout)
    except OSError:
        return None
    transport = paramiko.Transport(link)
    try:
        transport.banner_timeout = timeout
        transport.handshake_timeout = timeout
        transport.start_client(timeout=timeout)
        key = transport.get_remote_server_key().asbytes()
    except (paramiko.SSHException, OSError, EOFError):
        return None
    finally:
        transport.close()
        link.close()
    return base64.b64encode(hashlib.sha256(key).digest()).decode().rstrip("=")


def wait_for_job_sshd(
    key: str, address: str, port: int, public_key: Path, owner: int, deadline: float
) -> str:
    """Wait until the SSH server on `address:port` presents the key in `public_key` (a file of
    login `owner`, written by the job); its fingerprint.

    Raises `SessionError` past the monotonic `deadline`, or at once when a server
    there presents another key once the job's key is written.
    """
    while True:
        fingerprint = fingerprint_in(public_key, owner)
        if fingerprint:
            digest = presented_digest(address, port)
            if digest is not None:
                if f" SHA256:{digest} " in f" {fingerprint} ":
                    return fingerprint
                raise SessionError(
                    f"session {key}: port {port} on {address} is held by another SSH server "
                    f"(host key SHA256:{digest}, not the job's): the job cannot serve it"
                )
        if time.monotonic() > deadline:
            raise SessionError(f"the SSH server of {key} did not answer in time")
        time.sleep(POLL)
