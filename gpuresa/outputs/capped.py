"""A cap on each running session's output where the disk has no project quotas.

Project quotas (`disk.set_session_quota`) need XFS or ext4 mounted with
prjquota, which a freshly installed machine does not have. Elsewhere each
session's running output is a filesystem of its own: a sparse file
`<output_root>/.running-store/<safe key>.img` (root's, in the root-only
store), made with mkfs.ext4 and mounted with loop, nosuid and nodev at the
running path. A session that fills it gets ENOSPC, its user and its root alike
(no blocks are reserved for root), and the output disk loses only what was
written.

The image is sparse, so its cap is promised, not taken: `cap_refusal` counts
what every running image may still grow (its size less what it holds) and
refuses a new session whose cap would leave less than `free_refuse` free.

At the end the output is copied out of the image into its folder of the
store (`copying.copy_tree`: any depth, links stay links, nothing is
followed), and the image is
unmounted and removed; the hand-over then works on that folder as for any
output. A copy costs time for big outputs, but keeps one simple state after
the end (a plain folder, served by the output service, pruned by deleting):
an image kept mounted for the retention period would need mounts again after
each reboot, mount propagation into the output service's container and
unmounts before every prune. The copy is made before the image goes, so a
daemon killed at any point leaves the image and the record (see
`running_area.remember`), and the next maintenance round copies it again.
An output that cannot be copied out (a damaged image, a full disk) stays in
its image, which is recorded as an output of its own (`records.image_relative`):
listed, and removed with its image (`discard_image`) at the end of its
retention like any output.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import time
from pathlib import Path

from gpuresa.config.sections import Config
from gpuresa.outputs.copying import copy_tree
from gpuresa.outputs.disk import free_bytes, gibibytes, measure, mount_of, quota_problem
from gpuresa.outputs.running_area import (
    forget,
    in_host_namespace,
    running_path,
    store,
    stored_path,
)
from gpuresa.outputs.tree import remove_tree
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)

# what "auto" gives a preemptible session of its GPUs' share: a firm session prepared
# while one still runs on all the host's GPUs (it is stopped before that session starts)
# then finds room for its own cap, and the disk is never promised twice
PREEMPTIBLE_SHARE = 0.5
# what "auto" never goes below: a cap smaller than this is a refusal
SMALLEST_AUTO_CAP = 1024**3
# "auto" on a host without GPUs (demos, tests): the share of one session in this many
SHARES_WITHOUT_GPUS = 8
MOUNT_OPTIONS = "loop,nosuid,nodev"
# how long a hand-over waits for an ended session's image to be let go of elsewhere
READER_SETTLE = 5.0
# mkfs of a sparse image: no discard pass, inode tables and journal zeroed lazily
MKFS = (
    "mkfs.ext4",
    "-q",
    "-F",
    "-m",
    "0",
    "-E",
    "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
)
TIMEOUT = 120.0


def image_path(config: Config, key: str) -> Path:
    """Session `key`'s output image, in the root-only store (never mounted in a session)."""
    return store(config) / f"{safe_key(key)}.img"


def committed_bytes(config: Config) -> int:
    """What the images of the store may still grow: their sizes less the blocks they hold."""
    total = 0
    with contextlib.suppress(OSError):
        for image in store(config).glob("*.img"):
            details = image.lstat()
            total += max(0, details.st_size - details.st_blocks * 512)
    return total


def session_cap(
    config: Config, booked_gpus: int, host_gpus: int, preemptible: bool = False
) -> int | None:
    """The cap of a new session's output in bytes, or None for no cap.

    `session_quota` is a size, "none", or "auto": what the output disk has
    free above `free_refuse` (less what running images may still grow) times
    the booked GPUs over the host's GPUs (a session without GPUs counts one;
    a host without GPUs gives each session 1/`SHARES_WITHOUT_GPUS`), and
    `PREEMPTIBLE_SHARE` of that for a preemptible session. Raises `OSError`
    when the disk cannot be measured for "auto".
    """
    text = (config.storage.session_quota or "none").strip().lower()
    if text == "none":
        return None
    if text != "auto":
        return free_bytes(text, 0)
    state = measure(config.storage, config.daemon.state_dir)
    room = state.free - free_bytes(config.storage.free_refuse, state.total)
    room -= committed_bytes(config)
    shares = host_gpus or SHARES_WITHOUT_GPUS
    share = max(1, booked_gpus) / max(shares, booked_gpus)
    if preemptible:
        share *= PREEMPTIBLE_SHARE
    return max(0, int(room * share))


def cap_refusal(config: Config, limit: int) -> str | None:
    """Why a new output image of `limit` bytes may not be made now, or None."""
    try:
        state = measure(config.storage, config.daemon.state_dir)
    except OSError as error:
        return f"the output disk cannot be measured: {error}"
    keep = free_bytes(config.storage.free_refuse, state.total)
    promised = committed_bytes(config)
    if (config.storage.session_quota or "").strip().lower() == "auto":
        # the cap is this room's share, measured a moment ago: measured again it may be a
        # few blocks less (anything writing meanwhile), which is no reason to refuse
        if limit >= SMALLEST_AUTO_CAP:
            return None
        return (
            f"the output disk has no room for another session's output: {state.summary}, "
            f"{gibibytes(promised)} promised to running sessions, storage.free_refuse "
            f"({config.storage.free_refuse}) kept free"
        )
    if state.free - promised - limit < keep:
        return (
            f"the output disk cannot hold another session's output cap of {gibibytes(limit)}: "
            f"{state.summary}, {gibibytes(promised)} promised to running sessions, "
            f"storage.free_refuse ({config.storage.free_refuse}) kept free"
        )
    return None


def run_tool(*command: str) -> None:
    """Run `command` (mount, mkfs, umount…); raises `OSError` with its error output."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OSError(f"{command[0]}: {error}") from None
    if result.returncode != 0:
        raise OSError(f"{' '.join(command[:2])}…: {result.stderr.strip() or result.returncode}")


def loop_devices_of(image: Path) -> list[str]:
    """The loop devices backed by `image` (`losetup -j`)."""
    try:
        result = subprocess.run(
            ["losetup", "-j", str(image)], capture_output=True, text=True, timeout=TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OSError(f"losetup: {error}") from None
    return [line.split(":", 1)[0] for line in result.stdout.splitlines() if line.strip()]


def mount_capped(config: Config, key: str, folder: Path, limit: int) -> None:
    """Mount a fresh (or the existing) image of `limit` bytes at the running `folder`.

    Nothing happens when `folder` is already a mount (a session made again).
    Raises `SessionError` with the reason when there is no room, no free loop
    device, or mkfs or mount fails (the image is then removed again).
    """
    if os.path.ismount(folder):
        return
    if not in_host_namespace():
        # a mount made here would not be seen by the engine: the cap would only seem kept
        log.warning(
            "%s: storage.session_quota is not kept: this process runs in a mount namespace "
            "of its own (the unit's hardening), where a loop mount does not reach the engine",
            key,
        )
        return
    image = image_path(config, key)
    made = False
    try:
        if not image.exists():
            refusal = cap_refusal(config, limit)
            if refusal is not None:
                raise SessionError(f"session {key}: {refusal}")
            descriptor = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            made = True
            try:
                os.ftruncate(descriptor, limit)
            finally:
                os.close(descriptor)
            run_tool(*MKFS, str(image))
        run_tool("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(folder))
        # mkfs's lost+found would be the first thing in the user's output
        with contextlib.suppress(OSError):
            (folder / "lost+found").rmdir()
    except OSError as error:
        if made:
            image.unlink(missing_ok=True)
        raise SessionError(
            f"session {key}: its output cannot be capped at {gibibytes(limit)} "
            f"(a filesystem image mounted with loop): {error}"
        ) from None
    log.info("%s: output %s capped at %s (image %s)", key, folder, gibibytes(limit), image)


def cap_output(
    config: Config,
    key: str,
    folder: Path,
    booked_gpus: int,
    host_gpus: int,
    preemptible: bool = False,
) -> None:
    """Cap session `key`'s running output `folder`: project quota, else an image.

    Raises `SessionError` when the cap cannot be kept (no room on the disk, no
    loop device, mkfs or mount failed): a session never runs uncapped when
    a cap is configured.
    """
    from gpuresa.outputs.disk import set_session_quota

    try:
        limit = session_cap(config, booked_gpus, host_gpus, preemptible)
    except OSError as error:
        raise SessionError(f"session {key}: the output disk cannot be measured: {error}") from None
    if limit is not None:
        mount = mount_of(folder)
        if quota_problem(mount) is None:
            try:
                set_session_quota(folder, limit, mount)
                limit = None
            except OSError as error:
                log.warning("%s: project quota refused (%s); using an image instead", key, error)
    if limit is not None:
        mount_capped(config, key, folder, limit)


def release_capped(config: Config, key: str, running: Path, stored: Path) -> None:
    """Copy an ended session's image into `stored`, then unmount and remove it.

    Nothing happens when the session has no image. Given the running path
    (where the image may still be mounted) and the store's folder (the
    hand-over's source). The copy goes to any depth, whatever the names
    (`copying.copy_tree`). Raises `OSError` when the copy, mount or unmount
    fails: the image stays whole, nothing half-copied is left in `stored`,
    and the hand-over is retried.
    """
    image = image_path(config, key)
    # the image's mount at the running path, and one shown at the store's path (shared
    # peers), go first: a mount point cannot be renamed, and the copy reads a private mount
    for point in (running, stored):
        while os.path.ismount(point):
            run_tool("umount", str(point))
    if not image.is_file():
        return
    _room_to_copy(config, image)
    # the image is the output: what is at `stored` is its empty mount point, or what
    # a daemon killed during an earlier copy left
    remove_tree(stored)
    reader = store(config) / f".{safe_key(key)}.copy"
    reader.mkdir(mode=0o700, exist_ok=True)
    try:
        _mount_reader(image, reader)
        try:
            copy_tree(reader, stored)
        finally:
            run_tool("umount", str(reader))
    finally:
        with contextlib.suppress(OSError):
            reader.rmdir()
    image.unlink(missing_ok=True)
    log.info("%s: output copied out of its image into %s", key, stored)


def _mount_reader(image: Path, reader: Path) -> None:
    """Mount `image` read-only at `reader`; raises `OSError`.

    Right after a stop, the ended container's mount namespace may still hold
    the image mounted read-write (the kernel tears it down after its last
    process, a moment after the engine says the container is gone): `mount`
    then takes the image's loop device again and the kernel refuses it read-only
    ("already mounted"). Tried again while a loop device backed by the image was
    there before the try, for up to `READER_SETTLE` seconds; a mount that fails
    with none (a damaged image) fails at once.
    """
    deadline = time.monotonic() + READER_SETTLE
    while True:
        held = False
        with contextlib.suppress(OSError):  # unknown: a failed mount fails at once
            held = bool(loop_devices_of(image))
        try:
            run_tool("mount", "-t", "ext4", "-o", f"{MOUNT_OPTIONS},ro", str(image), str(reader))
            return
        except OSError:
            if not held or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _room_to_copy(config: Config, image: Path) -> None:
    """Raise `OSError` (ENOSPC) when copying what `image` holds would take the output disk
    below `free_refuse`, less what running sessions' images may still grow.

    Copied there anyway, it would fill the disk under the running sessions (their
    images are sparse) and fail, each round again; kept in its image, it is
    listed and removed at the end of its retention like any output.
    """
    details = image.stat()
    needed = details.st_blocks * 512
    state = measure(config.storage, config.daemon.state_dir)
    keep = free_bytes(config.storage.free_refuse, state.total)
    # this image's own promise ends with the copy: only the others' count
    promised = committed_bytes(config) - max(0, details.st_size - needed)
    if state.free - promised - needed < keep:
        raise OSError(
            errno.ENOSPC,
            f"the output disk has no room to copy {gibibytes(needed)} out of its image: "
            f"{state.summary}, {gibibytes(promised)} promised to running sessions, "
            f"storage.free_refuse ({config.storage.free_refuse}) kept free",
        )


def discard_image(config: Config, key: str) -> bool:
    """Remove session `key`'s output kept in its image (its retention is over).

    Unmounts it where it is still mounted, removes the image, what a failed
    copy left in the store and the record of the pending hand-over. Returns
    whether an image was there; raises `OSError` when it cannot be removed.
    """
    for point in (running_path(config, key), stored_path(config, key)):
        while os.path.ismount(point):
            run_tool("umount", str(point))
    image = image_path(config, key)
    found = image.is_file()
    image.unlink(missing_ok=True)
    remove_tree(stored_path(config, key))
    forget(config, key)
    log.info("%s: output kept in its image %s removed (retention over)", key, image)
    return found
