"""An idmapped bind mount: a folder shown elsewhere with its file owners shifted.

A user's home keeps its owners as the session sees them, shifted to a base of
its own on disk (`paths.DISK_ID_BASE`): on Docker every session's ids are the
engine's one remapped range,
on Podman each session has a range of its own, chosen when its main container
is made. Rather than rewriting every owner in the home at each start (a conda
environment holds a hundred thousand files), each session gets a view of the
home through an idmapped mount (Linux 5.12 and later): a bind whose ids pass
through a user namespace that maps the session's ids (0-65535) onto its host
range. The session reads and writes its own ids; the home on disk keeps the
same ones, whichever range the next session gets.

Neither the standard library nor a maintained package wraps `open_tree`,
`mount_setattr` and `move_mount` (util-linux's `mount -o X-mount.idmap` came
in 2.39; Debian 12 ships 2.38), so they are called here through `ctypes`. The
user namespace that carries the mapping is that of a short-lived
`unshare --user` child, whose maps root writes; the mount keeps the namespace
once made, and the child is gone before this returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpuresa.model import IdRange

# x86_64 and aarch64 (the generic table) number these three alike
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
OPEN_TREE_CLONE = 0x1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000
# how long the helper may take to enter its user namespace
NAMESPACE_TIMEOUT = 10.0


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def _libc() -> ctypes.CDLL:
    library = ctypes.CDLL(None, use_errno=True)
    library.syscall.restype = ctypes.c_long
    return library


def _checked(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


@dataclass(frozen=True)
class IdMaps:
    """How a view shows the home's ids: uid_map and gid_map lines (inside, host, count)."""

    uids: tuple[tuple[int, int, int], ...]
    gids: tuple[tuple[int, int, int], ...]

    @classmethod
    def of_range(cls, ids: IdRange, base: int) -> IdMaps:
        """The home's ids `base`.. (a session's 0.. on disk) shown as a session's host range
        (Docker, Podman)."""
        return cls(((base, ids.uid, ids.count),), ((base, ids.gid, ids.count),))

    @classmethod
    def of_login(cls, inside: int, host_uid: int, host_gid: int, base: int) -> IdMaps:
        """The login's own id on disk (`base + inside`) shown as its host account's
        (udocker: no namespace of its own)."""
        return cls(((base + inside, host_uid, 1),), ((base + inside, host_gid, 1),))


def _text(lines: tuple[tuple[int, int, int], ...]) -> str:
    return "".join(f"{inside} {host} {count}\n" for inside, host, count in lines)


def _namespace_of(uid_map: str, gid_map: str) -> int:
    """An open descriptor of a fresh user namespace with these maps (the caller closes it)."""
    mine = os.readlink("/proc/self/ns/user")
    child = subprocess.Popen(
        ["unshare", "--user", "sleep", "60"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + NAMESPACE_TIMEOUT
        folder = Path(f"/proc/{child.pid}")
        while os.readlink(folder / "ns" / "user") == mine:
            if child.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"unshare --user did not make a user namespace ({child.returncode})")
            time.sleep(0.001)
        (folder / "uid_map").write_text(uid_map)
        (folder / "gid_map").write_text(gid_map)
        return os.open(folder / "ns" / "user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(5)


def bind_idmapped(source: Path, target: Path, maps: IdMaps) -> None:
    """Mount `source` at `target` (an empty folder) with its ids shown through `maps`,
    nosuid and nodev. Raises `OSError` when the kernel or the filesystem refuses."""
    library = _libc()
    namespace = _namespace_of(_text(maps.uids), _text(maps.gids))
    try:
        tree = _checked(
            library.syscall(
                SYS_OPEN_TREE, AT_FDCWD, str(source).encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC
            ),
            f"open_tree {source}",
        )
        try:
            attributes = _MountAttr(
                MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, namespace
            )
            _checked(
                library.syscall(
                    SYS_MOUNT_SETATTR,
                    tree,
                    b"",
                    AT_EMPTY_PATH,
                    ctypes.byref(attributes),
                    ctypes.sizeof(attributes),
                ),
                f"idmapping {source}",
            )
            where = str(target).encode()
            flags = MOVE_MOUNT_F_EMPTY_PATH
            _checked(
                library.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, where, flags),
                f"mounting at {target}",
            )
        finally:
            os.close(tree)
    finally:
        os.close(namespace)
