"""The output disk: how full it is, what that means for new sessions, and quotas.

`disk_level` is pure (free and total bytes in, "ok", "warn" or "refuse" out);
`measure` asks the kernel (statvfs) and is what the daemon calls each round.
A full output disk must never stop the journal: `shares_state_disk` tells
when the state directory sits on the same filesystem, so the daemon can warn.

Per-session caps use project quotas where the disk has them (else an image
per session, see `capped`) (XFS, or ext4 mounted with prjquota): the
folder gets a project id (FS_IOC_FSSETXATTR with PROJINHERIT, so everything
made below it counts) and the limit is set with quotactl(Q_SETQUOTA, PRJQUOTA).
Both are system calls made here through ctypes and fcntl, because the usual
tools (xfs_quota, setquota) are separate packages absent from most hosts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuresa.config.checks import uncapped_output_warnings
from gpuresa.config.schema import Invalid, Share, Size, parse_size
from gpuresa.config.sections import Config, StorageConfig

log = logging.getLogger(__name__)

Level = Literal["ok", "warn", "refuse"]


def free_bytes(threshold: Size | Share | str, total: int) -> int:
    """The bytes `threshold` stands for on a disk of `total` bytes.

    A `Size` is its bytes, a `Share` its part of `total`: the config reads
    `free_warn` and `free_refuse` into these. A size still written as text
    ("20g", as `session_quota` is) is read as the config reads sizes; raises
    `ValueError` for anything else.
    """
    if isinstance(threshold, Share):
        return int(threshold.of(total))
    if isinstance(threshold, Size):
        return threshold.bytes
    try:
        return parse_size(threshold).bytes
    except Invalid as error:
        raise ValueError(str(error)) from None


def disk_level(free: int, total: int, storage: StorageConfig) -> Level:
    """ "refuse" below `free_refuse`, "warn" below `free_warn`, else "ok"."""
    if free < free_bytes(storage.free_refuse, total):
        return "refuse"
    if free < free_bytes(storage.free_warn, total):
        return "warn"
    return "ok"


def gibibytes(count: int) -> str:
    return f"{count / 1024**3:.1f} GiB"


@dataclass(frozen=True)
class DiskState:
    """The output filesystem as measured once: its level and the words to explain it."""

    path: Path
    free: int
    total: int
    level: Level
    shares_state_disk: bool
    threshold: Size | Share

    @property
    def summary(self) -> str:
        """One line: "12.0 GiB free of 100.0 GiB (12%) on /srv/gpuresa/output"."""
        share = 100 * self.free / self.total if self.total else 0.0
        return (
            f"{gibibytes(self.free)} free of {gibibytes(self.total)} ({share:.0f}%) on {self.path}"
        )

    @property
    def refusal(self) -> str | None:
        """Why a new session is refused now, or None when it may start."""
        if self.level != "refuse":
            return None
        return (
            f"the output disk is nearly full: {self.summary}, below storage.free_refuse "
            f"({self.threshold}); new sessions start again once space is freed"
        )


def _existing(path: Path) -> Path:
    """`path`, or its nearest folder that exists (a fresh host has no output root yet)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def shares_state_disk(state_dir: Path, output_root: Path) -> bool:
    """Whether the journal's folder and the outputs are on one filesystem (same st_dev)."""
    return _existing(state_dir).stat().st_dev == _existing(output_root).stat().st_dev


def measure(storage: StorageConfig, state_dir: Path) -> DiskState:
    """The output root's filesystem now (statvfs: space an unprivileged writer may use).

    Raises `OSError` when the filesystem cannot be asked.
    """
    where = _existing(storage.output_root)
    details = os.statvfs(where)
    free = details.f_bavail * details.f_frsize
    total = details.f_blocks * details.f_frsize
    level = disk_level(free, total, storage)
    threshold = storage.free_refuse if level == "refuse" else storage.free_warn
    return DiskState(
        storage.output_root, free, total, level, shares_state_disk(state_dir, where), threshold
    )


def start_refusal(config: Config, key: str = "") -> str | None:
    """Why a new session may not start now because of the output disk, or None.

    A disk that cannot be measured is logged and lets the session start: the
    check protects the disk, it must not become a reason of its own to fail.
    """
    try:
        state = measure(config.storage, config.daemon.state_dir)
    except OSError as error:
        log.warning("%s: cannot measure the output disk: %s", key, error)
        return None
    return state.refusal


# --- project quotas -------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """The mount that holds a path, from /proc/self/mountinfo."""

    point: Path
    device: str
    kind: str
    options: frozenset[str]


def mount_of(path: Path, mountinfo: str | None = None) -> Mount:
    """The innermost mount holding `path` (mountinfo text given, else read)."""
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    target = _existing(path).resolve()
    best: Mount | None = None
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        point = Path(fields[4].replace("\\040", " "))
        if target != point and point not in target.parents:
            continue
        options = frozenset(fields[5].split(",")) | frozenset(tail[2].split(","))
        candidate = Mount(point, tail[1], tail[0], options)
        if best is None or len(point.parts) >= len(best.point.parts):
            best = candidate
    return best or Mount(Path("/"), "", "unknown", frozenset())


PROJECT_QUOTA_OPTIONS = frozenset({"prjquota", "pquota", "pqnoenforce", "prjquota=on"})


def quota_problem(mount: Mount) -> str | None:
    """Why per-session caps cannot work on `mount`, or None when they can."""
    if mount.kind not in ("xfs", "ext4"):
        return (
            f"{mount.point} is {mount.kind}, which has no project quotas "
            "(use XFS, or ext4 mounted with prjquota)"
        )
    if not mount.options & PROJECT_QUOTA_OPTIONS:
        return f"{mount.point} ({mount.kind}) is not mounted with prjquota (or pquota on XFS)"
    return None


# struct fsxattr: fsx_xflags, fsx_extsize, fsx_nextents, fsx_projid, fsx_cowextsize, pad[8]
_FSXATTR = struct.Struct("IIIII8x")
FS_IOC_FSGETXATTR = 0x801C581F
FS_IOC_FSSETXATTR = 0x401C5820
FS_XFLAG_PROJINHERIT = 0x00000200
# quotactl(QCMD(Q_SETQUOTA, PRJQUOTA)); struct if_dqblk with only block limits set
Q_SETQUOTA = 0x800008
PRJQUOTA = 2
QIF_BLIMITS = 1


class _DiskQuota(ctypes.Structure):
    _fields_ = [
        ("bhardlimit", ctypes.c_uint64),
        ("bsoftlimit", ctypes.c_uint64),
        ("curspace", ctypes.c_uint64),
        ("ihardlimit", ctypes.c_uint64),
        ("isoftlimit", ctypes.c_uint64),
        ("curinodes", ctypes.c_uint64),
        ("btime", ctypes.c_uint64),
        ("itime", ctypes.c_uint64),
        ("valid", ctypes.c_uint32),
    ]


def project_id(path: Path) -> int:
    """A project id for a session folder: its inode number (unique on its filesystem)."""
    return path.lstat().st_ino & 0xFFFFFFFF


def set_session_quota(path: Path, limit: int, mount: Mount) -> None:
    """Cap what can be written below the folder `path` at `limit` bytes (project quota).

    Raises `OSError` when the filesystem refuses (no project quotas, not root).
    """
    project = project_id(path)
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        buffer = bytearray(_FSXATTR.size)
        fcntl.ioctl(descriptor, FS_IOC_FSGETXATTR, buffer)
        flags, extent, extents, _, cow = _FSXATTR.unpack(buffer)
        packed = _FSXATTR.pack(flags | FS_XFLAG_PROJINHERIT, extent, extents, project, cow)
        fcntl.ioctl(descriptor, FS_IOC_FSSETXATTR, packed)
    finally:
        os.close(descriptor)
    library = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    quota = _DiskQuota(bhardlimit=(limit + 1023) // 1024, valid=QIF_BLIMITS)
    command = (Q_SETQUOTA << 8) | PRJQUOTA  # QCMD(Q_SETQUOTA, PRJQUOTA)
    result = library.quotactl(
        command, mount.device.encode(), ctypes.c_int(project), ctypes.byref(quota)
    )
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"quotactl on {mount.device}: {os.strerror(error)}")
    log.info("output %s capped at %s (project %d)", path, gibibytes(limit), project)


def disk_warnings(config: Config) -> list[str]:
    """What the daemon says at start about the output disk: shared with the journal, no quotas."""
    storage = config.storage
    warnings = []
    if shares_state_disk(config.daemon.state_dir, storage.output_root):
        warnings.append(
            f"storage.output_root ({storage.output_root}) is on the same filesystem as "
            f"daemon.state_dir ({config.daemon.state_dir}): users filling it would stop the "
            "journal and the calendar snapshots; put the outputs on a filesystem of their own"
        )
    if (storage.session_quota or "none").lower() != "none":
        problem = quota_problem(mount_of(storage.output_root))
        if problem is not None:
            warnings.append(
                f"storage.session_quota is kept with a filesystem image per session "
                f"(loop mount) instead of project quotas: {problem}"
            )
    warnings.extend(uncapped_output_warnings(config))
    return warnings


def disk_report(config: Config) -> dict[str, object]:
    """The output disk for `gpuresa status`: level, space, why starts are refused, warnings."""
    try:
        state = measure(config.storage, config.daemon.state_dir)
    except OSError as error:
        return {"level": "unknown", "summary": f"cannot be measured: {error}", "refusal": None}
    return {
        "level": state.level,
        "free_bytes": state.free,
        "total_bytes": state.total,
        "summary": state.summary,
        "refusal": state.refusal,
        "warnings": disk_warnings(config),
    }
