"""A container's processes seen from the host: found in its cgroup, signalled directly.

Stopping a session must never run anything in it: the user is root there and
may have replaced every tool (`pkill`, `kill`, `timeout`…) with one that never
returns. So the processes are read from the container's cgroup on the host
(`/proc/<init>/cgroup` names it; its `cgroup.procs` lists every member, in
cgroups v1, v2 and the hybrid layout) and signalled with `pidfd_send_signal`,
after checking through the pidfd's process that it is still a member (a pid
reused by another program between the listing and the signal is left alone).

The container's init (Docker's, `"Init": true`) and its first child (the
entrypoint that became sshd) are kept out of the SIGTERM: if sshd exited, the
init would exit and the kernel would SIGKILL the user's processes before their
grace was over. They go with the SIGKILL that ends the stop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import stat
import time
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
# cgroups v1 controllers every Docker container is in, tried in this order
_V1_CONTROLLERS = ("pids", "memory", "freezer", "cpu")


def cgroup_of(pid: int) -> Path | None:
    """The cgroup folder holding process `pid`, or None when it is gone or has none.

    cgroups v1 (a controller's hierarchy), v2, or hybrid (v1 controllers plus
    /sys/fs/cgroup/unified): the first folder that exists with a cgroup.procs.
    """
    try:
        lines = (PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    by_controller: dict[str, str] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            by_controller[controller] = path
    candidates = [
        CGROUP_ROOT / controller / by_controller[controller].lstrip("/")
        for controller in _V1_CONTROLLERS
        if controller in by_controller
    ]
    if "" in by_controller:
        unified = by_controller[""].lstrip("/")
        candidates += [CGROUP_ROOT / unified, CGROUP_ROOT / "unified" / unified]
    for folder in candidates:
        # "/" would be the host's root cgroup: never a container's
        if (
            folder not in (CGROUP_ROOT, CGROUP_ROOT / "unified")
            and (folder / "cgroup.procs").is_file()
        ):
            return folder
    return None


def members(folder: Path) -> set[int]:
    """Every process in cgroup `folder` and the cgroups below it (host pids)."""
    found: set[int] = set()
    for current, _, _ in os.walk(folder):
        with contextlib.suppress(OSError):
            text = (Path(current) / "cgroup.procs").read_text()
            found.update(int(line) for line in text.split() if line.isdigit())
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """A process's parent pid and start time (clock ticks after boot), or None when gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ")"
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def processes_to_end(init_pid: int, folder: Path) -> set[int]:
    """The processes of a container that a stop sends SIGTERM: all but its init and main process.

    Given the host pid of the container's init and its cgroup folder. The
    main process is the init's oldest child (orphans adopted by the init
    later are the user's and are included).
    """
    found = members(folder)
    children = []
    for pid in found:
        details = _stat(pid)
        if details is not None and details[0] == init_pid:
            children.append((details[1], pid))
    kept = {init_pid}
    if children:
        kept.add(min(children)[1])
    return found - kept


def send(pids: set[int], number: signal.Signals, folder: Path) -> int:
    """Send signal `number` to each of `pids` still in cgroup `folder`; returns how many got it."""
    sent = 0
    for pid in sorted(pids):
        try:
            descriptor = os.pidfd_open(pid)
        except OSError:
            continue  # already gone
        try:
            # the pidfd holds this very process: check it is still the container's
            if cgroup_of(pid) != folder:
                continue
            signal.pidfd_send_signal(descriptor, number)
            sent += 1
        except ProcessLookupError:
            continue
        except PermissionError as error:
            log.warning("cannot signal process %d: %s (gpuresa needs CAP_KILL)", pid, error)
        finally:
            os.close(descriptor)
    return sent


def remaining(init_pid: int, folder: Path) -> set[int]:
    """The processes a stop still waits for: `processes_to_end` less the zombies.

    Processes started after the SIGTERM (a handler saving its work) count too.
    """
    running = set()
    for pid in processes_to_end(init_pid, folder):
        try:
            text = (PROC / str(pid) / "stat").read_text()
        except OSError:
            continue
        if text[text.rindex(")") + 2 :].split()[0] != "Z":
            running.add(pid)
    return running


# --- the engine's keepers of a container's ports ------------------------------------------


def engine_process(pid: int, program: str | None = None) -> bool:
    """Whether process `pid` is one of the host's own services: root's, run from root's binary.

    Its name proves nothing (any host user, and root in any session, names a
    process as it likes); its uids and its executable do. Every uid (real,
    effective, saved, filesystem) must be 0, and /proc/PID/exe must resolve to a
    file owned by root that nobody else may write, named `program` when given.
    Root in a session is never host uid 0 (user namespaces), and a host user
    cannot become it. When the kernel will not show the executable (a daemon
    without CAP_SYS_PTRACE reading a process with more capabilities than its
    own, as conmon has), the ids alone decide: such a process is the host's.
    """
    entry = PROC / str(pid)
    try:
        status = (entry / "status").read_text()
    except OSError:
        return False
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    if not uids or any(value != "0" for value in uids):
        return False
    try:
        target = os.readlink(entry / "exe")
        details = os.stat(entry / "exe")
    except PermissionError:
        return True
    except OSError:
        return False  # gone, or a kernel thread (no executable): nothing that holds ports
    if details.st_uid != 0 or details.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    name = PurePosixPath(target.removesuffix(" (deleted)")).name
    return program is None or name == program


def port_keepers(container_ids: set[str]) -> dict[int, int]:
    """Podman's conmon processes of `container_ids`: pid to start time.

    Rootful Podman reserves a container's host ports by binding them itself
    and handing the sockets to the container's conmon, which keeps them until
    it exits, a moment after the container is removed (after its exit
    command, a `podman container cleanup`, has run: seconds on a loaded
    host). Docker's containers have none (its docker-proxy goes with the
    removal). Read from /proc: a conmon's `-c` argument is its container's id;
    a process only counts when it is root's, run from root's conmon (see
    `engine_process`): a host user's "conmon -c <id>" would hold up every stop.
    """
    keepers: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "conmon":
                continue
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for flag, value in itertools.pairwise(arguments):
            if flag == b"-c" and value.decode(errors="replace") in container_ids:
                stat_fields = _stat(int(entry.name))
                if stat_fields is not None and engine_process(int(entry.name), "conmon"):
                    keepers[int(entry.name)] = stat_fields[1]
    return keepers


def _running(pid: int, started: int) -> bool:
    """Whether process `pid` (started at `started`) is still there and not a zombie."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0] != "Z" and int(fields[19]) == started


def wait_exited(processes: dict[int, int], timeout: float) -> set[int]:
    """Wait up to `timeout` s for `processes` (pid to start time) to exit; the pids left."""
    deadline = time.monotonic() + timeout
    left = {pid for pid, started in processes.items() if _running(pid, started)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {pid for pid in left if _running(pid, processes[pid])}
    return left


def listening_programs(ports: set[int]) -> dict[int, set[str]]:
    """The programs (their `comm`) listening on each of `ports` (TCP, IPv4 and IPv6).

    Read from /proc/net/tcp{,6} (a listener's socket inode) and every process's
    descriptors; a port whose listener belongs to no process seen here maps to
    an empty set. A program that is not the host's own (see `engine_process`)
    is named with its uid, "conmon (uid 1001)", so that a host user's program
    named like an engine's is never taken for it.
    """
    inodes: dict[str, int] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (PROC / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) < 10 or fields[3] != "0A":  # LISTEN
                    continue
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port in ports:
                    inodes[f"socket:[{fields[9]}]"] = port
    found: dict[int, set[str]] = {port: set() for port in inodes.values()}
    if not inodes:
        return found
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for descriptor in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    held = inodes.get(os.readlink(descriptor))
                    if held is not None:
                        found[held].add(_program(entry))
    return found


def _program(entry: Path) -> str:
    """The name of the process at `entry` (/proc/PID), with its uid unless it is the host's."""
    name = (entry / "comm").read_text().strip()
    if engine_process(int(entry.name)):
        return name
    try:
        uid = os.stat(entry).st_uid
    except OSError:
        return f"{name} (gone)"
    return f"{name} (uid {uid})"
