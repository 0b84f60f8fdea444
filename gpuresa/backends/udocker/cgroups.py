"""The cgroups gpuresa owns for each udocker session (cgroup v1 controllers).

Every process of a session starts in
`/sys/fs/cgroup/<controller>/gpuresa/<host>@<installation>/<key>` (`cgroup_folders.host_folder`;
its first process writes itself there as root, then drops to the user): runc,
run rootless, cannot make cgroups of its own there (the folders are root's), so
the container and everything it forks stay in them, whatever sessions or
process groups they make. A user cannot move a process out either: every
other cgroup's `cgroup.procs` is root's. So the cgroup is the session, for
limits (memory, CPU, processes), for finding its processes after a daemon
restart, and for the stop: frozen (no fork escapes), SIGKILLed, thawed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from gpuresa.sessions.cgroup_folders import CGROUP_ROOT, CONTROLLERS, OPTIONAL
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.limits import SessionLimits

log = logging.getLogger(__name__)

CPU_PERIOD_US = 100_000
POLL = 0.05


class SessionCgroup:
    """The cgroup folders of one session, one per controller."""

    def __init__(self, base: Path, name: str, root: Path = CGROUP_ROOT) -> None:
        """`base`: the folder of its host's sessions (`cgroup_folders.host_folder`)."""
        self.root = root
        self.relative = base / name

    def folder(self, controller: str) -> Path:
        return self.root / controller / self.relative

    def controllers(self) -> list[str]:
        """The controllers this host mounts (the required ones, and the optional present)."""
        optional = [name for name in OPTIONAL if (self.root / name / "cgroup.procs").exists()]
        return [*CONTROLLERS, *optional]

    def procs_files(self) -> list[Path]:
        """Every `cgroup.procs` a session's first process writes itself into."""
        return [self.folder(name) / "cgroup.procs" for name in self.controllers()]

    def exists(self) -> bool:
        return self.folder("pids").is_dir()

    def create(self, limits: SessionLimits, pids: int) -> None:
        """Make the folders (root's, mode 0755) and write the session's `limits` (its share of
        the host, `gpuresa.sessions.limits`) and `pids`; raises `SessionError`.

        Memory and memory plus swap get the same limit, as on the engines: a session
        cannot page out past it; CPUs are a CFS quota per period.
        """
        try:
            for name in self.controllers():
                _make_folder(self.folder(name))
            _write(self.folder("pids") / "pids.max", str(pids))
            memory = self.folder("memory")
            _write(memory / "memory.limit_in_bytes", str(limits.memory))
            # the kernel accounts swap only when booted with swapaccount
            if (memory / "memory.memsw.limit_in_bytes").exists():
                _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory))
            _write(self.folder("cpu") / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            quota = max(int(limits.cpus * CPU_PERIOD_US), 1000)
            _write(self.folder("cpu") / "cpu.cfs_quota_us", str(quota))
        except OSError as error:
            raise SessionError(
                f"cannot make the session's cgroup {self.relative}: {error}"
            ) from None

    def deny_devices(self, devices: Iterable[tuple[str, int, int]]) -> None:
        """Deny the session's processes these (type, major, minor) devices (before any process
        joins); a host without the "devices" controller cannot, and is told in the log."""
        folder = self.folder("devices")
        devices = list(devices)
        if not folder.is_dir():
            if devices:
                log.warning("%s: no devices cgroup: other GPUs not denied", self.relative)
            return
        for kind, major, minor in devices:
            try:
                _write(folder / "devices.deny", f"{kind} {major}:{minor} rwm")
            except OSError as error:
                raise SessionError(f"cannot deny device {major}:{minor}: {error}") from None

    def members(self) -> list[int]:
        """The pids in the session's cgroup (none when it is gone)."""
        try:
            text = (self.folder("pids") / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(line) for line in text.split() if line.isdigit()]

    def signal(self, pids: Iterable[int], number: signal.Signals) -> int:
        """Send `number` to each of `pids` still in the cgroup; returns how many were sent.

        Each process is held by a pidfd before the cgroup is read: a pid that a
        process outside the session took over meanwhile is never signalled.
        """
        held: dict[int, int] = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                held[pid] = os.pidfd_open(pid)
        sent = 0
        try:
            members = set(self.members())
            for pid, descriptor in held.items():
                if pid not in members:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(descriptor, number)
                    sent += 1
        finally:
            for descriptor in held.values():
                os.close(descriptor)
        return sent

    def kill_all(self, settle: float = 10.0) -> bool:
        """Freeze, SIGKILL every member, thaw; returns whether the cgroup emptied in `settle`.

        Frozen first so nothing forks between the listing and the kill.
        """
        state = self.folder("freezer") / "freezer.state"
        frozen = False
        with contextlib.suppress(OSError):
            _write(state, "FROZEN")
            frozen = True
        deadline = time.monotonic() + settle
        while frozen and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if state.read_text().strip() == "FROZEN":
                    break
            time.sleep(POLL)
        while True:
            members = self.members()
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if frozen:
                with contextlib.suppress(OSError):
                    _write(state, "THAWED")
                    frozen = False
            if not members:
                return True
            if time.monotonic() > deadline:
                log.error("%s: %d processes outlived SIGKILL", self.relative, len(members))
                return False
            time.sleep(POLL)

    def remove(self, settle: float = 5.0) -> None:
        """Remove the (emptied) folders; logs, never raises.

        A killed process leaves `cgroup.procs` a moment before the kernel lets its
        cgroup go (rmdir says EBUSY meanwhile), and one being placed there as the
        kill ran may still arrive: each busy folder is tried again, its members
        killed again, for up to `settle` seconds.
        """
        deadline = time.monotonic() + settle
        for name in self.controllers():
            folder = self.folder(name)
            while True:
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("cannot remove cgroup %s: %s", folder, error)
                        break
                    for pid in self.members():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    time.sleep(POLL)
                else:
                    break
        # the host's folder goes with its last session (`_make_folder` makes it again)
        for name in self.controllers():
            with contextlib.suppress(OSError):  # another session's is in it
                self.folder(name).parent.rmdir()


def listed(base: Path, root: Path = CGROUP_ROOT) -> list[str]:
    """The names of the session cgroups under `base` (what a restarted daemon finds)."""
    folder = root / "pids" / base
    try:
        return sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
    except OSError:
        return []


def remove_others(base: Path, kept: Collection[str], root: Path = CGROUP_ROOT) -> list[str]:
    """Kill and remove the session cgroups under `base` whose name is not in `kept`; theirs."""
    removed = []
    for name in listed(base, root):
        if name not in kept:
            cgroup = SessionCgroup(base, name, root)
            cgroup.kill_all()
            cgroup.remove()
            removed.append(name)
    return removed


def chosen(
    base: Path, host: str, name: str, first: Callable[[SessionCgroup], int | None], root: Path
) -> SessionCgroup:
    """Session `name`'s cgroup under `base`; or, for a session started before the folder
    carried its installation, the one under `gpuresa/<host>` in which `first` finds the
    session's first process as this installation recorded it (another installation's of the
    same host name and key holds another process, and is never taken)."""
    current = SessionCgroup(base, name, root)
    if current.exists():
        return current
    earlier = SessionCgroup(Path("gpuresa") / host, name, root)
    if earlier.exists() and first(earlier) is not None:
        return earlier
    return current


def _make_folder(folder: Path, tries: int = 5) -> None:
    """mkdir -p `folder`, each missing folder root's 0755 (mkdir's `parents` would make
    the host's 0777 less the umask: with a lax one, a host user could make a session's
    folder of their own in it, and own its limits). Made again when its host's folder
    was removed between two mkdirs (that host's last session ending, `SessionCgroup.remove`).
    """
    for attempt in range(tries):
        levels = [folder, *folder.parents]
        missing = levels[: next(index for index, level in enumerate(levels) if level.is_dir())]
        try:
            for level in reversed(missing):
                with contextlib.suppress(FileExistsError):
                    level.mkdir(mode=0o755)
            return
        except FileNotFoundError:
            if attempt == tries - 1:
                raise


def _write(path: Path, text: str) -> None:
    with path.open("w") as handle:
        handle.write(text)
