"""SSH and SFTP logins with paramiko, as a user with a key or a password would log in.

One way to log in for every test: 127.0.0.1, no agent, no keys of the
machine's own user (only the key or password given), and a timeout on
every step, so that a session that never answers fails the test instead of
hanging it. Host keys are not checked here: the tests of host certificates
check them on purpose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import paramiko

# what a login that is refused or not served yet raises (a closed port, a banner
# that never comes, a connection dropped by sshd)
REFUSED = (paramiko.SSHException, OSError, EOFError)


def connect(
    port: int,
    login: str,
    key: paramiko.PKey | Path | None = None,
    *,
    password: str | None = None,
    timeout: float = 10,
) -> paramiko.SSHClient:
    """A client logged in to 127.0.0.1:`port` as `login` with `key` (or its file) or `password`.

    Raises what paramiko raises when the login fails (`AuthenticationException`
    when refused, an `SSHException`, `OSError` or `EOFError` when not served).
    """
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    try:
        client.connect(
            "127.0.0.1",
            port,
            username=login,
            pkey=key if isinstance(key, paramiko.PKey) else None,
            key_filename=str(key) if isinstance(key, Path) else None,
            password=password,
            allow_agent=False,
            look_for_keys=False,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
        )
    except BaseException:
        client.close()
        raise
    return client


@contextlib.contextmanager
def ssh_login(
    port: int,
    login: str,
    key: paramiko.PKey | Path | None = None,
    *,
    password: str | None = None,
    timeout: float = 10,
) -> Iterator[paramiko.SSHClient]:
    """`connect`, closed at the end of the block."""
    client = connect(port, login, key, password=password, timeout=timeout)
    try:
        yield client
    finally:
        client.close()


def try_login(
    port: int, login: str, key: paramiko.PKey | Path | None, *, timeout: float = 2
) -> paramiko.SSHClient | None:
    """A client logged in now, or None when the login is refused or not served (yet).

    For `wait_for`: short timeouts, so that a poll that fails is soon tried again.
    """
    try:
        return connect(port, login, key, timeout=timeout)
    except REFUSED:
        return None


@contextlib.contextmanager
def sftp_login(
    port: int, login: str, key: paramiko.PKey | Path, *, timeout: float = 10
) -> Iterator[paramiko.SFTPClient]:
    """An SFTP client of `login` on 127.0.0.1:`port`, closed with its connection."""
    with ssh_login(port, login, key, timeout=timeout) as client:
        sftp = client.open_sftp()
        try:
            yield sftp
        finally:
            sftp.close()


def run(client: paramiko.SSHClient, command: str, timeout: float = 20) -> tuple[int, str]:
    """Run `command` in the login's shell: its exit status, and its stdout then stderr."""
    _, stdout, stderr = client.exec_command(command, timeout=timeout)
    output = stdout.read().decode() + stderr.read().decode()
    return stdout.channel.recv_exit_status(), output
