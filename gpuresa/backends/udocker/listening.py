"""A udocker session's SSH port: bound by root, served by the login's own sshd per connection.

gpuresa binds the session's port itself (a privileged one by default, which no
host user can bind, before, during or after the session) and hands the socket
to a small root process in the session's cgroup (`scripts/listener.py`). For
each connection, that listener forks a child that becomes the login and runs
`sshd -i` on it (OpenSSH's inetd mode), so the login's sshd serves the session
as before, in its cgroup, and never holds the port. The listener is detached
like the container: it outlives a daemon's restart (a new daemon finds it by
its pid, recorded in the session's root-owned folder, checked to be root's and
in the cgroup) and dies with the session's cgroup. Whether a session answers is
asked of that process and of the socket gpuresa bound, never of whoever
greets on the port.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from gpuresa.access import host_account
from gpuresa.backends.udocker import launch
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.backends.udocker.records import Record, write_file
from gpuresa.backends.udocker.tools import SCRIPTS
from gpuresa.sessions.errors import SessionError

LISTENER = SCRIPTS / "listener.py"
# what the listener names itself (/proc/PID/comm), and the file its pid is kept in
LISTENER_NAME = "gpuresa-listen"
PID_FILE = "listener.pid"
# connections served at once: all told, and from one address (a host user fills at most
# the host's own share; the login's own connections come from its machine)
MAX_CONNECTIONS = 32
MAX_PER_SOURCE = 12
SSHD = "/usr/sbin/sshd"


def bind(address: str, port: int) -> socket.socket:
    """A listening TCP socket on `address`:`port`, root's; `SessionError` when it cannot be."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a session just ended may leave connections in TIME_WAIT on the port
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(64)
    except OSError as error:
        listener.close()
        raise SessionError(
            f"cannot listen on ssh port {port} of {address}: {error.strerror} "
            "(another process holds it)"
        ) from None
    return listener


def start(
    cgroup: SessionCgroup,
    record: Record,
    folder: Path,
    address: str,
    deadline: float,
    bound: socket.socket | None = None,
) -> int:
    """Bind the session's port on `address` (or take `bound`, a socket `bind` gave for it,
    which is closed here), start its listener in `cgroup` and wait until the login's sshd
    greets through it; returns the listener's pid (also kept in `folder`).

    Raises `SessionError` when the port is taken, the login is not the record's any more,
    or nothing greets by `deadline`.
    """
    account = host_account(record.spec.user)
    if account is None or account.uid != record.uid:
        if bound is not None:
            bound.close()
        raise SessionError(f"login {record.spec.user!r} is not uid {record.uid} any more")
    address, port = address or "0.0.0.0", record.spec.ssh_port
    config_file = folder / "sshd_config"
    listener = bound if bound is not None else bind(address, port)
    try:
        command = [
            sys.executable, "-I", str(LISTENER), str(listener.fileno()),
            str(account.uid), str(account.gid), account.login,
            str(MAX_CONNECTIONS), str(MAX_PER_SOURCE),
            SSHD, "-i", "-e", "-f", str(config_file),
        ]  # fmt: skip
        launch.spawn(
            cgroup,
            None,
            command,
            {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"},
            folder / "sshd.log",
            pass_fds=(listener.fileno(),),
        )
    finally:
        # the listener has its own copy: the port is held while it runs, and no longer
        listener.close()
    launch.wait_for("the session's listener", lambda: find(cgroup), deadline)
    pid = find(cgroup)
    assert pid is not None
    write_file(folder / PID_FILE, f"{pid}\n")
    probe = "127.0.0.1" if address in ("0.0.0.0", "") else "::1" if address == "::" else address
    # the port is the listener's (bound above, and no one else may bind it while it is held):
    # a greeting there is the login's sshd, started by it
    launch.wait_for(f"sshd on port {port}", lambda: launch.ssh_answers(probe, port), deadline)
    return pid


def find(cgroup: SessionCgroup) -> int | None:
    """The listener among the cgroup's members: root's, by its name (none: None)."""
    for pid in cgroup.members():
        if _is_listener(pid):
            return pid
    return None


def recorded(cgroup: SessionCgroup, folder: Path) -> int | None:
    """The session's listener as recorded at its start, if it still runs in the cgroup."""
    try:
        pid = int((folder / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    if pid not in cgroup.members() or not _is_listener(pid):
        return None
    return pid


def _is_listener(pid: int) -> bool:
    """Whether `pid` is a listener: its name, and root's (a login may name a process so)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    return comm == LISTENER_NAME and uids == ["0", "0", "0", "0"]
