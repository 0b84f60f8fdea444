"""A login's home image: made at its first use, checked, and mounted where only root goes.

Each image is a sparse ext4 filesystem of `[storage] home_quota` bytes with no
blocks kept for root. Its files keep the session's ids shifted to
`DISK_ID_BASE` (`paths`): a set-uid file of a session's root is, on disk,
nobody's, wherever the image were mounted.

- Made as `<login>.img.new` and renamed into place once `mkfs` is done, so a
  daemon killed meanwhile leaves no half-made home to refuse its user for good.
- Mounted (loop, nosuid, nodev, discard: what a user frees goes back to the
  disk) only if it is a regular file of root's, mode 0600, with one link,
  and on no loop device yet (two mounts of one ext4 image would damage it).
- Sparse images promise more than they take: a home is mounted only if the
  disk keeps `[storage] free_refuse` free once every mounted home has grown
  to its cap; otherwise one user's full home would fail another's writes with
  I/O errors. Running outputs are not counted: their "auto" cap is already
  the session's share of the free disk, taken when it starts (so a home and
  an output on one disk can still promise it twice).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from pathlib import Path

from gpuresa.config.sections import Config
from gpuresa.homes.paths import DISK_ID_BASE, image_path, mounted_path
from gpuresa.outputs.capped import loop_devices_of, run_tool
from gpuresa.outputs.disk import free_bytes, gibibytes
from gpuresa.outputs.running_area import unmount

log = logging.getLogger(__name__)

MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,discard"
# mkfs of a sparse image: no blocks kept for root, no discard pass, tables zeroed lazily
MKFS = ("mkfs.ext4", "-q", "-F", "-m", "0")
MKFS_EXTENDED = "lazy_itable_init=1,lazy_journal_init=1,nodiscard"
SKELETON = Path("/etc/skel")


def mount_home(config: Config, login: str, inside_uid: int) -> Path:
    """`login`'s home mounted (made first if new, owned by `inside_uid` as sessions see
    it); its mount point. Raises `OSError` with the reason."""
    point = mounted_path(config, login)
    if os.path.ismount(point):
        return point
    image = image_path(config, login)
    made = not image.exists()
    if made:
        make_image(config, image, DISK_ID_BASE + inside_uid)
    check_image(image)
    holders = loop_devices_of(image)
    if holders:
        # another installation, or a mount left by hand, has it
        raise OSError(f"{image} is in use elsewhere ({', '.join(holders)})")
    room_problem = _room_problem(config, image)
    if room_problem is not None:
        raise OSError(errno.ENOSPC, room_problem)
    point.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        run_tool("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(point))
        if made:
            first_files(point, DISK_ID_BASE + inside_uid)
    except OSError:
        if made:
            with contextlib.suppress(OSError):
                unmount(point)
            image.unlink(missing_ok=True)
        raise
    return point


def check_image(image: Path) -> None:
    """Raise `OSError` unless `image` is a regular file of root's, 0600, with one link."""
    descriptor = os.open(image, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        details = os.fstat(descriptor)
    finally:
        os.close(descriptor)
    if not stat.S_ISREG(details.st_mode) or details.st_uid != 0:
        raise OSError(f"{image} is not a file of root's")
    if details.st_mode & 0o077 or details.st_nlink != 1:
        raise OSError(f"{image} is open to others or has other names: not mounted")


def _promised(image: Path) -> int:
    """What `image` may still take on its disk: its size less what it holds."""
    details = image.stat()
    return max(0, details.st_size - details.st_blocks * 512)


def _room_problem(config: Config, image: Path) -> str | None:
    """Why mounting `image` could fill its disk under the mounted homes, or None."""
    details = os.statvfs(image.parent)
    free, total = details.f_bavail * details.f_frsize, details.f_blocks * details.f_frsize
    keep = free_bytes(config.storage.free_refuse, total)
    promised = _promised(image)
    for other in image.parent.glob("*.img"):
        if other != image and os.path.ismount(mounted_path(config, other.stem)):
            with contextlib.suppress(OSError):
                promised += _promised(other)
    if free - promised >= keep:
        return None
    return (
        f"the disk of {image.parent} has no room for this home to grow to its cap: "
        f"{gibibytes(free)} free of {gibibytes(total)}, {gibibytes(promised)} promised to "
        "the homes in use, "
        f"storage.free_refuse ({config.storage.free_refuse}) kept free"
    )


def make_image(config: Config, image: Path, owner: int) -> None:
    """A fresh image at `image`, its root folder `owner`'s (made aside, then renamed)."""
    quota = config.storage.home_quota
    assert quota != "off"
    fresh = image.with_name(image.name + ".new")
    fresh.unlink(missing_ok=True)  # a daemon killed while it made one
    descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(descriptor, quota.bytes)
    finally:
        os.close(descriptor)
    try:
        run_tool(*MKFS, "-E", f"{MKFS_EXTENDED},root_owner={owner}:{owner}", str(fresh))
        os.rename(fresh, image)
    except OSError:
        fresh.unlink(missing_ok=True)
        raise
    log.info("home image %s made (%d bytes, sparse)", image, quota.bytes)


def first_files(home: Path, owner: int, group: int | None = None, mode: int = 0o700) -> None:
    """A new home (no one but root can enter it yet): no lost+found in the user's way, the
    host's shell start files, each made anew (never through a link), `owner`'s."""
    gid = owner if group is None else group
    with contextlib.suppress(OSError):
        (home / "lost+found").rmdir()
    with contextlib.suppress(OSError):
        for entry in SKELETON.iterdir():
            if not entry.is_file() or entry.is_symlink():
                continue
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            descriptor = os.open(home / entry.name, flags, 0o644)
            with os.fdopen(descriptor, "wb") as copy, entry.open("rb") as source:
                shutil.copyfileobj(source, copy)
                os.fchown(copy.fileno(), owner, gid)
    os.chmod(home, mode)
