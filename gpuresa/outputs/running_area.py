"""Where a running session's output lives: a root-only, nosuid, nodev folder of the output disk.

While a session runs, its output is written by the container's root, which
on Docker is one host uid shared by every session. Anything that session
leaves in its output (a set-uid copy of a shell, a file with capabilities, a
folder opened to everyone) must reach nobody on the host. So a running output
is not in its final place but in `<output_root>/.running-store/<safe key>`,
which its containers bind from the running area, `<state_dir>/running-outputs/<safe key>`:

- `.running-store` and the area are root's, mode 0700: no host account
  reaches a running output, whatever modes the session gives its own files;
- the area is a mount of its own (a bind of `.running-store`) with nosuid and
  nodev, and every bind mount of a folder below it (the session's main
  container and FTP sidecar) inherits both flags, which a user namespace
  cannot clear: a set-uid file or a device node made there does nothing, in
  the session or out;
- the area is outside the output root: a container that binds the whole
  output root (the output service) would otherwise get a copy of the area and
  of each session's output image mounted in it (`outputs.capped`), and such a
  copy, in a user namespace, cannot be unmounted while its container lives:
  every ended session's image, its loop device and its blocks would stay;
- the area is mounted once, however many sessions are prepared at once: the
  check and the mount are made under a lock (`area_lock`);
- next to each folder, `<safe key>.json` (root's, never mounted) says where the
  output goes at the end and whose it is, so a hand-over that failed, or that a
  daemon restart or a host reboot interrupted, is finished later.

At the end the tree is handed over in place (see `gpuresa.outputs.tree`:
made root's and read-only, privilege bits and capabilities cleared, at any
depth) and only then renamed to its final path through `.running-store`: a
rename across two mounts fails (EXDEV) even on one filesystem, so it never
goes through the area's mount.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuresa.config.sections import Config
from gpuresa.outputs.disk import mount_of
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)

# in the daemon's state folder, outside the output root (see above)
RUNNING_FOLDER = "running-outputs"
STORE_FOLDER = ".running-store"
# in the store (root-only): held while the area is checked and mounted
LOCK_FILE = ".area.lock"
AREA_MODE = 0o700
# <sys/mount.h>
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MNT_DETACH = 2
# the mount namespace the engines work in (where a session's bind mounts are made)
HOST_MOUNTINFO = Path("/proc/1/mountinfo")
REQUIRED_OPTIONS = frozenset({"nosuid", "nodev"})


@dataclass(frozen=True)
class Pending:
    """A running (or not yet handed over) output: its folder and where it goes."""

    key: str
    user: str
    folder: Path
    final: Path
    # the host uid that wrote it from the host (udocker, Slurm), None for a session's container
    writer: int | None = None
    # when its record was written (seconds since the epoch): a session being made has one
    # before its containers show
    written: float = 0.0


def area(config: Config) -> Path:
    """`<state_dir>/running-outputs`: the root-only mount that shows running outputs."""
    return config.daemon.state_dir / RUNNING_FOLDER


def store(config: Config) -> Path:
    """`<output_root>/.running-store`: the real folder behind the `.running` mount."""
    return config.storage.output_root / STORE_FOLDER


def running_path(config: Config, key: str) -> Path:
    """Session `key`'s output seen through the nosuid mount: what its containers bind."""
    return area(config) / safe_key(key)


def stored_path(config: Config, key: str) -> Path:
    """Session `key`'s output on the output root's own mount: what is renamed."""
    return store(config) / safe_key(key)


def _record_path(config: Config, key: str) -> Path:
    return store(config) / f"{safe_key(key)}.json"


def _mount(source: str | None, target: Path, flags: int) -> None:
    library = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    result = library.mount(
        source.encode() if source else None, str(target).encode(), None, flags, None
    )
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {target}: {os.strerror(error)}")


def area_problem(path: Path) -> str | None:
    """Why `path` is not (yet) a nosuid, nodev, root-only mount, or None when it is."""
    details = path.lstat()
    if not stat.S_ISDIR(details.st_mode) or details.st_uid != 0:
        return f"{path} is not a folder of root's"
    if stat.S_IMODE(details.st_mode) != AREA_MODE:
        return f"{path} has mode {stat.S_IMODE(details.st_mode):o}, not {AREA_MODE:o}"
    mount = mount_of(path, HOST_MOUNTINFO.read_text())
    if mount.point != path.resolve():
        return f"{path} is not a mount of its own"
    missing = REQUIRED_OPTIONS - mount.options
    if missing:
        return f"{path} is mounted without {', '.join(sorted(missing))}"
    return None


def ensure_area(config: Config) -> Path:
    """Make the running area root's, 0700, and a nosuid, nodev mount of its own; returns it.

    Idempotent: each start calls it, so a host reboot (which drops the mount)
    or an admin's chmod is repaired before any session's output is mounted.
    Sessions prepared at once (threads of one daemon, a daemon and an admin's
    command) make one mount between them: the check and the mount are made
    under a lock of the store's. Raises `SessionError` when it cannot be made
    so (fails closed: no session starts with its output where a set-uid file
    would work).
    """
    path = area(config)
    try:
        config.storage.output_root.mkdir(parents=True, exist_ok=True)
        config.daemon.state_dir.mkdir(parents=True, exist_ok=True)
        for folder in (store(config), path):
            if folder.is_symlink():
                raise SessionError(f"{folder} is a symbolic link; refusing to use it")
            folder.mkdir(mode=AREA_MODE, exist_ok=True)
            os.lchown(folder, 0, 0)
            os.chmod(folder, AREA_MODE)
        if area_problem(path) is None:
            return path
        if not in_host_namespace():
            raise SessionError(
                f"{path} is not a nosuid, nodev mount and this process cannot make it one "
                "(it runs in a mount namespace of its own, which the engine does not see): "
                "run the daemon in the host's mount namespace (no ProtectSystem=, PrivateTmp= "
                "or ReadWritePaths= in its unit), or `gpuresa outputs prepare-area` as root"
            )
        with area_lock(config):
            _mount_area(config, path)
        problem = area_problem(path)
    except OSError as error:
        raise SessionError(f"cannot prepare {path} for running outputs: {error}") from None
    if problem is not None:
        raise SessionError(f"running outputs cannot be kept safely: {problem}")
    return path


@contextlib.contextmanager
def area_lock(config: Config) -> Iterator[None]:
    """Hold the running area's lock (a root-only file of the store, flock'd) while inside.

    flock locks belong to an open file, so two threads of one process wait
    for each other as two processes do. Raises `OSError` when it cannot be taken.
    """
    descriptor = os.open(
        store(config) / LOCK_FILE,
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _mount_area(config: Config, path: Path) -> None:
    """Bind the store on `path` unless this namespace's mountinfo shows it there, then make
    the top mount nosuid and nodev (the caller holds the area's lock)."""
    points = mount_points(Path("/proc/self/mountinfo").read_text())
    if path.resolve() not in points:
        _mount(str(store(config)), path, MS_BIND)
    _mount(None, path, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)


def mount_points(mountinfo: str) -> list[Path]:
    """Every mount point of `mountinfo`'s text, in its order (a point stacked twice shows twice)."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.append(Path(unescape(fields[4])))
    return points


def unescape(field: str) -> str:
    """A mountinfo path field as a path: the kernel writes space, tab, newline and
    backslash as three octal digits after a backslash."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def in_host_namespace() -> bool:
    """Whether this process mounts where the engines see it (unknown: try, the mount says)."""
    try:
        return os.readlink("/proc/self/ns/mnt") == os.readlink("/proc/1/ns/mnt")
    except OSError:
        return True


def release_area(config: Config) -> None:
    """Unmount the running area, every mount stacked there (lazily); gone is done.

    For a host with no running session: a mount of the area no session needs
    keeps its output root busy. Raises `OSError` when an unmount is refused.
    """
    path = area(config)
    with area_lock(config) if store(config).is_dir() else contextlib.nullcontext():
        while path.resolve() in mount_points(Path("/proc/self/mountinfo").read_text()):
            unmount(path)


def unmount(point: Path) -> None:
    """Detach the top mount at `point` (lazily: its last user frees it). Raises `OSError`."""
    library = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if library.umount2(str(point).encode(), MNT_DETACH) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"umount {point}: {os.strerror(error)}")


def remember(config: Config, key: str, user: str, final: Path, writer: int | None = None) -> None:
    """Write where session `key`'s output goes at the end (root's, next to its folder).

    `writer` is the host uid that wrote the output outside a container, if any.
    """
    record = _record_path(config, key)
    temporary = record.with_suffix(".tmp")
    text = json.dumps({"key": key, "user": user, "final": str(final), "writer": writer})
    descriptor = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)
    os.replace(temporary, record)


def forget(config: Config, key: str) -> None:
    """Drop session `key`'s record once its output is in its final place."""
    _record_path(config, key).unlink(missing_ok=True)


def pending(config: Config) -> list[Pending]:
    """Every output still in the running area, with where it goes (unreadable records skipped)."""
    found = []
    try:
        records = sorted(store(config).glob("*.json"))
    except OSError:
        return []
    for record in records:
        try:
            values = json.loads(record.read_text())
            key, user, final = str(values["key"]), str(values["user"]), Path(values["final"])
            writer = values.get("writer")
            writer = None if writer is None else int(writer)
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.error("unreadable record of a running output %s: %s", record, error)
            continue
        try:
            written = record.stat().st_mtime
        except OSError:
            written = 0.0
        found.append(Pending(key, user, stored_path(config, key), final, writer, written))
    return found
