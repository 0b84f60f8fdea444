"""Starting a udocker session's processes in its cgroup, as its user, detached from gpuresa.

Each process is started by a root shell that first writes its own pid into
every `cgroup.procs` of the session (so everything it becomes or forks is
counted there) and then becomes the user with `setpriv`; `setsid -f` detaches
it, so sessions outlive the daemon. Two such processes per session: the
container (`udocker run`, then runc, then `session.sh`), as the user, and the
listener on the session's port (`listening`), root's, which runs the user's own
sshd for each connection (no privilege separation: it runs as the user, whom it
alone lets in), whose ForceCommand enters the container.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuresa.access import Account
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.backends.udocker.tools import SCRIPTS, as_user
from gpuresa.sessions.errors import SessionError

POLL = 0.05


def spawn(
    cgroup: SessionCgroup,
    account: Account | None,
    command: Sequence[str],
    env: Mapping[str, str],
    log_file: Path,
    pass_fds: Sequence[int] = (),
) -> None:
    """Start `command` as `account` (None: as root) in `cgroup`, detached, with the
    descriptors `pass_fds`; its output appended to `log_file`."""
    joins = " ".join(f"echo $$ > {shlex.quote(str(path))} &&" for path in cgroup.procs_files())
    run = command if account is None else as_user(account, command)
    inner = f"{joins} exec {shlex.join(run)}"
    with log_file.open("ab") as output:
        os.chmod(log_file, 0o644)
        result = subprocess.run(
            ["setsid", "-f", "/bin/sh", "-c", inner],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            cwd="/",
            timeout=30,
            check=False,
            pass_fds=tuple(pass_fds),
        )
    if result.returncode != 0:
        raise SessionError(f"cannot start {command[0]} in the session's cgroup")


def container_init(cgroup: SessionCgroup, uid: int) -> int | None:
    """The pid of the container's first process: the user's, PID 1 of a namespace of its own."""
    for pid in cgroup.members():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nspids = fields.get("NSpid", "").split()
        uids = fields.get("Uid", "").split()
        if len(nspids) >= 2 and nspids[-1] == "1" and uids[:1] == [str(uid)]:
            return pid
    return None


def init_pid(cgroup: SessionCgroup, folder: Path) -> int | None:
    """The container's first process as recorded at its start (`container.pid`), if it runs."""
    return _recorded(cgroup, folder / "container.pid")


def _recorded(cgroup: SessionCgroup, path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid in cgroup.members() else None


def _parent(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[1])


def machinery(cgroup: SessionCgroup, folder: Path, listener: int | None) -> set[int]:
    """The pids that make the session up (udocker, runc, the container's first process, and
    the `listener` on its port).

    What a stop's SIGTERM spares: the user's own processes are all the others.
    """
    spared: set[int] = set()
    pid = init_pid(cgroup, folder)
    while pid is not None and pid in set(cgroup.members()):
        spared.add(pid)
        pid = _parent(pid)
    if listener is not None:
        spared.add(listener)
    return spared


def sshd_config(
    login: str,
    folder: Path,
    files: Path,
    host_key: Path,
) -> str:
    """The configuration of the session's `sshd -i`: the user's keys only, into the container
    only (the port is the listener's)."""
    enter = SCRIPTS / "enter.sh"
    return "\n".join(
        [
            "# gpuresa udocker session: sshd -i run by the user, for the user",
            f"HostKey {host_key}",
            "PidFile none",
            f"AuthorizedKeysFile {folder / 'authorized_keys'}",
            # the keys file is gpuresa's, in root's folders (the test sites' parents are not)
            "StrictModes no",
            "UsePAM no",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin no",
            f"AllowUsers {login}",
            f"Banner {files / 'banner'}",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "LoginGraceTime 30",
            "ClientAliveInterval 60",
            f"ForceCommand /bin/sh {enter} {folder} {files}",
            "Subsystem sftp /usr/lib/openssh/sftp-server",
            "",
        ]
    )


def wait_for(what: str, found: object, deadline: float) -> None:
    """Raise `SessionError` when `found` (a callable) stays falsy until `deadline`."""
    assert callable(found)
    while not found():
        if time.monotonic() > deadline:
            raise SessionError(f"{what} did not come up in time")
        time.sleep(POLL)


def ssh_answers(address: str, port: int) -> bool:
    """Whether an SSH server greets on address:port."""
    try:
        with socket.create_connection((address, port), timeout=1) as connection:
            connection.settimeout(2)
            return connection.recv(8).startswith(b"SSH-")
    except OSError:
        return False
