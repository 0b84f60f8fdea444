"""A gpuresa udocker session's SSH port: root holds it, the login's sshd serves each connection.

Run by root, with the session's listening socket (bound by gpuresa) as a file
descriptor, in the session's cgroup. Standalone (the standard library only):
it outlives the daemon that started it, and its end is the session's (its
cgroup is killed). For each connection it forks a child that drops to the login
(its uid, gid and groups) and runs `sshd -i` on the connection, inetd style, so
the child and all it starts stay in the session's cgroup, and the port is one
that no host user can bind, take over or answer on, between sessions or after.

It never reads from a connection. At most `total` connections are served at
once, at most `per_source` from one source: an address, or the host itself
for any of its own addresses (a host user may connect from any of them, all
of 127.0.0.0/8 included), so host users cannot take every place of the
session, whose login comes from elsewhere; one over is closed at once.

Arguments: FD UID GID LOGIN TOTAL PER_SOURCE SSHD ARGUMENT...
"""

import ctypes
import os
import select
import socket
import sys
import time

PR_SET_NAME = 15
# what gpuresa checks before taking this process for the session's listener
NAME = b"gpuresa-listen"
REAP_EVERY = 5.0


def main() -> None:
    descriptor, uid, gid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    login, total, per_source = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    command = sys.argv[7:]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, NAME, 0, 0, 0)
    listener = socket.socket(fileno=descriptor)
    # no child may keep it: the login's sshd would hold root's port
    listener.set_inheritable(False)
    groups = os.getgrouplist(login, gid)
    children: dict[int, str] = {}
    environment = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}
    while True:
        # awake now and then without a connection, to reap the children that ended
        ready, _, _ = select.select([listener], [], [], REAP_EVERY)
        _reap(children)
        if not ready:
            continue
        try:
            connection, address = listener.accept()
        except OSError as error:
            print(f"gpuresa-listen: accept failed: {error}", file=sys.stderr, flush=True)
            time.sleep(0.5)
            continue
        source = _source(str(address[0]))
        if len(children) >= total or list(children.values()).count(source) >= per_source:
            print(f"gpuresa-listen: too many connections; {source} refused",
                  file=sys.stderr, flush=True)  # fmt: skip
            connection.close()
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _serve(connection, uid, gid, groups, command, environment)
            finally:
                os._exit(127)
        children[pid] = source
        connection.close()


def _source(address: str) -> str:
    """Where a connection comes from: "this host" for any of its own addresses (those a
    socket may be bound to), else the address."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return address
    return "this host"


def _reap(children: dict[int, str]) -> None:
    """Forget the children that ended (and let them go)."""
    while children:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.pop(pid, None)


def _serve(
    connection: socket.socket,
    uid: int,
    gid: int,
    groups: list[int],
    command: list[str],
    environment: dict[str, str],
) -> None:
    """In the child: the connection as stdin and stdout, the login's ids, then sshd -i."""
    os.dup2(connection.fileno(), 0)
    os.dup2(connection.fileno(), 1)
    connection.close()
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    os.execve(command[0], command, environment)


if __name__ == "__main__":
    main()
