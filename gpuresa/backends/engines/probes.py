"""Readiness probes: is a session's sshd or FTP server really answering?"""

from __future__ import annotations

import socket

import paramiko


def ssh_handshake(address: str, port: int, timeout: float) -> bool:
    """True when an SSH server at address:port sends its banner and completes a key exchange."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as probe:
            probe.settimeout(timeout)
            if not probe.recv(64).startswith(b"SSH-2.0-"):
                return False
    except OSError:
        return False
    transport: paramiko.Transport | None = None
    try:
        connection = socket.create_connection((address, port), timeout=timeout)
        transport = paramiko.Transport(connection)
        transport.banner_timeout = timeout
        transport.start_client(timeout=timeout)
        return transport.is_active() and transport.get_remote_server_key() is not None
    except (OSError, EOFError, paramiko.SSHException):
        return False
    finally:
        if transport is not None:
            transport.close()


def ftp_greeting(address: str, port: int, timeout: float) -> bool:
    """True when an FTP server at address:port sends its 220 greeting."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as probe:
            probe.settimeout(timeout)
            greeting = b""
            while b"\n" not in greeting and len(greeting) < 1024:
                chunk = probe.recv(1024)
                if not chunk:
                    break
                greeting += chunk
            ready = greeting.startswith(b"220")
            if ready:
                probe.sendall(b"QUIT\r\n")
            return ready
    except OSError:
        return False
