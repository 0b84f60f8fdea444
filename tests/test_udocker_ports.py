"""A udocker session's SSH port: root's, on the default privileged range, never a squatter's.

Real udocker and runc, a host account of each test's own, paramiko logins, and
host processes of that login (setpriv) playing the host shell that tries to
bind, squat or flood the session's port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import paramiko
import pytest
from support.logins import connect
from support.waiting import wait_for
from test_udocker import Site, alive, login_fixture, make_fixture, site_fixture, spec_of

from gpuresa.access import host_account
from gpuresa.backends.udocker import UdockerBackend, launch, listening
from gpuresa.config.schema import PortRange
from gpuresa.model import SessionSpec
from gpuresa.sessions.errors import SessionError

pytestmark = pytest.mark.services
__all__ = ["login_fixture", "make_fixture", "site_fixture"]

# a host process that listens on a port and greets every connection as an sshd would
SQUATTER = r"""
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen(8)
print("listening", flush=True)
while True:
    connection, _ = server.accept()
    connection.sendall(b"SSH-2.0-x\r\n")
    connection.close()
"""
BIND = r"""
import socket, sys
try:
    socket.socket().bind(("127.0.0.1", int(sys.argv[1])))
    print("bound")
except OSError as error:
    print(error.strerror)
"""


def listening_sockets(port: int) -> list[tuple[int, int]]:
    """(owner uid, inode) of every socket listening on `port` in this network namespace."""
    found = []
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.append((int(fields[7]), int(fields[9])))
    return found


def holders(inode: int) -> set[int]:
    """The pids that hold socket `inode` open."""
    pids = set()
    for folder in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for entry in folder.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(entry) == f"socket:[{inode}]":
                        pids.add(int(folder.parent.name))
    return pids


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def owner_of(pid: int) -> int | None:
    """Process `pid`'s uid, or None once it is gone."""
    with contextlib.suppress(OSError, StopIteration):
        return uid_of(pid)
    return None


def as_login(login: str, script: str, *arguments: str) -> list[str]:
    return ["setpriv", "--reuid", login, "--regid", login, "--clear-groups",
            sys.executable, "-I", "-c", script, *arguments]  # fmt: skip


@contextlib.contextmanager
def squatter(login: str, port: int) -> Iterator[None]:
    """A host process of `login` listening on `port` and greeting as an sshd."""
    process = subprocess.Popen(as_login(login, SQUATTER, str(port)), stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"listening\n"
        yield
    finally:
        process.kill()
        process.wait()


def greets(port: int, source: str = "127.0.0.1") -> socket.socket | None:
    """A connection from `source` that an SSH server greeted (kept open), or None."""
    connection = socket.socket()
    connection.bind((source, 0))
    connection.settimeout(15)
    connection.connect(("127.0.0.1", port))
    try:
        if connection.recv(8).startswith(b"SSH-2.0-"):
            return connection
    except OSError:
        pass
    connection.close()
    return None


def first_greeting(port: int, seconds: float = 15) -> socket.socket:
    """A greeted connection, once a place is free (a closed one's sshd ends in a moment)."""
    return wait_for(lambda: greets(port), seconds, "a free place", every=0.2)


def listener_of(backend: UdockerBackend, key: str) -> int | None:
    return listening.recorded(backend.cgroup(key), backend.records.folder(key))


def members_running(backend: UdockerBackend, key: str, command: bytes) -> list[int]:
    """The session's processes whose command line is `command` (NUL-separated)."""
    found = []
    for pid in backend.cgroup(key).members():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == command:
                found.append(pid)
    return found


def command_of(pid: int) -> str | None:
    """Process `pid`'s command name, or None once it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return None


def kill_listener(backend: UdockerBackend, key: str) -> None:
    """SIGKILL the session's listener (as a crash would) and wait for its end."""
    listener = listener_of(backend, key)
    assert listener is not None
    os.kill(listener, signal.SIGKILL)
    wait_for(lambda: not alive(listener), 15, "the listener's end")


def free_privileged_port(ports: PortRange) -> int:
    """A port of `ports` that nothing listens on now (other tests may hold some)."""
    for port in ports:
        if not listening_sockets(port):
            return port
    raise AssertionError(f"every port of {ports} is taken")


def start_in_a_daemon_killed_after(backend: UdockerBackend, spec: SessionSpec) -> None:
    """Start the session in a child process (a daemon) and SIGKILL it once it has."""
    reading, writing = os.pipe()
    # the child waits on this pipe for its kill; it reads its end (EOF) should the test die first
    held, holding = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: it reports and waits for its kill
        os.close(reading)
        os.close(holding)
        try:
            backend.start(spec)
            os.write(writing, b"started")
        except BaseException as error:
            os.write(writing, f"failed: {error}"[:4000].encode())
        os.read(held, 1)
        os._exit(1)
    os.close(writing)
    os.close(held)
    try:
        assert os.read(reading, 4096) == b"started"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(reading)
        os.close(holding)


def test_a_session_on_the_default_privileged_ports_logs_in_through_roots_port(
    make: Callable[..., Site],
) -> None:
    site = make(ssh_ports=None)
    host = site.config.host()
    assert host.ssh_ports == PortRange(223, 254)  # the default
    backend = site.backend()
    spec = dataclasses.replace(
        spec_of(site, backend), ssh_port=free_privileged_port(host.ssh_ports)
    )
    port = spec.ssh_port
    # the daemon that starts it is killed at once: the session, its port and logins go on
    start_in_a_daemon_killed_after(backend, spec)
    adopted = site.backend().session(spec.key)
    assert adopted is not None and adopted.state == "running"
    code, text = site.run(adopted, "id -un; echo inside")
    assert code == 0 and text.split() == [site.login, "inside"], text
    # the one socket on the port is root's, held by the session's listener alone, which
    # runs in the session's cgroup
    sockets = listening_sockets(port)
    assert [owner for owner, _ in sockets] == [0], sockets
    listener = listener_of(backend, spec.key)
    assert listener is not None and holders(sockets[0][1]) == {listener}
    assert uid_of(listener) == 0 and listener in backend.cgroup(spec.key).members()
    # a login's connection is served by the login's own sshd, in the session's cgroup,
    # which holds no listening socket
    account = host_account(site.login)
    assert account is not None
    client = connect(port, site.login, site.root / "private" / site.login, timeout=15)
    try:
        members = backend.cgroup(spec.key).members()
        # each read once: a connection's short-lived sshd child may be gone meanwhile
        served = {
            pid: owner
            for pid in members
            if command_of(pid) == "sshd" and alive(pid) and (owner := owner_of(pid)) is not None
        }
        assert served and set(served.values()) == {account.uid}
        held = {inode for _, inode in listening_sockets(port)}
        assert all(not holders(inode) & served.keys() for inode in held)
    finally:
        client.close()
    # a host shell of the login cannot bind the port
    bound = subprocess.run(as_login(site.login, BIND, str(port)), capture_output=True, text=True)
    assert bound.stdout.strip() == "Permission denied", bound
    # the end of the session closes its port
    backend.stop(spec.key, timedelta(seconds=1))
    assert listening_sockets(port) == []
    assert not alive(listener)


def test_a_squatter_on_the_port_is_never_taken_for_the_session(site: Site) -> None:
    """The attack: a host login greets as an sshd on a free port of the session range (an
    unprivileged one here, as a site may configure; the defaults are not bindable)."""
    backend = site.backend()
    spec = spec_of(site, backend)
    port = spec.ssh_port
    with squatter(site.login, port):
        with pytest.raises(SessionError, match=f"cannot listen on ssh port {port}"):
            backend.start(spec)
        assert backend.session(spec.key) is None
        assert not backend.cgroup(spec.key).exists()
    session = backend.start(spec)
    assert session.state == "running"
    code, text = site.run(session, "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo left")
    assert code == 0, text
    command = b"sleep\x001000\x00"
    wait_for(lambda: members_running(backend, spec.key, command), 15, "the process left behind")
    [sleeper] = members_running(backend, spec.key, command)
    # the listener dies (root's: only a crash or root ends it): the session is "stopped",
    # and its next start listens again, the login's processes left as they were
    kill_listener(backend, spec.key)
    assert site.backend().session(spec.key).state == "stopped"  # type: ignore[union-attr]
    again = backend.start(spec)
    assert again.state == "running" and alive(sleeper)
    assert site.run(again, "echo back")[1].strip() == "back"
    # once more, and this time the login squats the freed port and greets there: that is
    # never the session answering, and its start fails rather than hand the port over
    kill_listener(backend, spec.key)
    with squatter(site.login, port):
        assert launch.ssh_answers("127.0.0.1", port)
        assert site.backend().session(spec.key).state == "stopped"  # type: ignore[union-attr]
        with pytest.raises(SessionError, match=f"cannot listen on ssh port {port}"):
            backend.start(spec)
        assert backend.session(spec.key) is None
        assert not backend.cgroup(spec.key).exists()


def test_connections_at_once_are_limited_per_address_and_per_session(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = site.backend()
    spec = spec_of(site, backend)
    monkeypatch.setattr(listening, "MAX_PER_SOURCE", 3)
    session = backend.start(spec)
    port = session.ssh_port
    held: list[socket.socket] = []
    try:
        # the host gets its share and no more, whichever of its addresses a host user
        # connects from (any of 127.0.0.0/8 is the host's)
        for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            connection = greets(port, source)
            assert connection is not None, source
            held.append(connection)
        assert greets(port) is None
        assert greets(port, "127.0.0.9") is None
        # a connection that ends frees its place
        held.pop(0).close()
        held.append(first_greeting(port))
    finally:
        for connection in held:
            connection.close()
        held.clear()
    # the session's total, whoever connects (a listener started again takes the new limits)
    monkeypatch.setattr(listening, "MAX_PER_SOURCE", 12)
    monkeypatch.setattr(listening, "MAX_CONNECTIONS", 2)
    kill_listener(backend, spec.key)
    session = backend.start(spec)
    try:
        held += [first_greeting(port), first_greeting(port)]
        assert greets(port) is None
    finally:
        for connection in held:
            connection.close()

    # the session still serves logins once the held connections' places are free again
    # (each one's sshd ends a moment after its connection closes)
    def logs_in() -> bool:
        try:
            return site.run(session, "echo still")[1].strip() == "still"
        except (paramiko.SSHException, OSError):
            return False

    wait_for(logs_in, 15, "a login once the places are free")
