"""A cap on each session's writable layer: a filesystem of its own under the engine's layer.

What a session writes outside its mounts (apt and pip installs, files in /root,
/tmp, anywhere in its root filesystem) lands in its container's writable layer,
a folder of the engine's storage (/var/lib/docker, /var/lib/containers): one
session writing without end would fill it, and then no container starts on the
host and gpuresa's own journal stops. Where the engine can cap that layer
itself (overlay over XFS mounted with `pquota`: the engine's `StorageOpt
size`), that is used. Everywhere else, and so on a fresh machine's ext4, each
session's layer gets a filesystem of its own:

1. the main container is created (not started): the engine has made its layer
   folder (`GraphDriver.Data.UpperDir`'s parent: `diff`, `work`, `link`, `lower`);
2. a sparse file of `[limits] layer_size` is made in gpuresa's state folder,
   formatted ext4 (no journal, inode tables left to be written as used:
   about 0.1 s and a few MiB on disk), filled with a copy of the layer folder
   and mounted over it through a loop device; the file itself is then unlinked,
   so the mount alone keeps it;
3. the engine mounts the container's overlay on that folder at start: a write
   past the cap fails with ENOSPC for that session only (`df /` inside shows the
   cap), whatever the rate and whether or not the file is still linked;
4. when the engine removes the container it unmounts the busy folder itself
   (Docker's and Podman's removal both unmount what is mounted there), the loop
   device is freed (autoclear) and with it the space.

Chosen over a periodic `du` of the layer from the host, which a fast writer
outruns between two samples and which cannot see a file deleted while held
open; and over a read-only root with writable volumes, which breaks `apt
install` (dpkg writes /usr and /etc) unless whole system folders are copied at
each start.

Not covered: the output folder (its own quota, see `outputs.disk`), /dev/shm
(memory, counted in the memory limit), the engine's own logs of the container
(its log driver's rotation), images and build caches (the admin's), and the
sum of the caps: sparse files take space as they fill, so sessions together can
still fill the disk when `layer_size` times the number of sessions is more than
the disk has free. After a host reboot the mounts are gone with the
containers' processes; a session made again gets a new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpuresa.backends.engines.engine import Engine
from gpuresa.config.schema import Size
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

# ext4 without a journal (the layer dies with its session), nosuid and nodev (a set-id
# file or a device node left in a layer gives nothing to anyone), inode tables initialised
# lazily and never in the background (`noinit_itable`): the file stays sparse
MKFS = ("mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0",
        "-E", "lazy_itable_init=1,nodiscard")  # fmt: skip
MOUNT_OPTIONS = "loop,nosuid,nodev,noinit_itable"
COMMAND_TIMEOUT = 30


# in the daemon's state folder: the backing files, each unlinked once mounted
LAYERS_FOLDER = "layers"


@dataclass(frozen=True)
class LayerPlan:
    """How a session's writable layer is capped: by the engine (`settings`) or a mount."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    size: int | None = None

    def cap(self, engine: Engine, state_dir: Path, container: str, key: str) -> None:
        """Mount the layer's own filesystem on created `container`, when this plan needs one.

        Given the engine and the daemon's state folder (where the backing file
        is made). Raises `SessionError` as `cap_layer` does.
        """
        if self.size is None:
            return
        inspected = engine.inspect(container, key)
        if inspected is None:
            raise SessionError(f"session {key}: its main container is gone before its start")
        scratch = state_dir / LAYERS_FOLDER
        cap_layer(layer_folder(inspected), self.size, scratch, key)


def layer_plan(size: Size | Literal["off"], info: Mapping[str, Any]) -> LayerPlan:
    """The cap of `[limits] layer_size` (`size`) on the engine whose `info` is given.

    Nothing for "off"; the engine's own size option where `info` shows it can.
    """
    if size == "off":
        return LayerPlan()
    if storage_option_supported(info):
        return LayerPlan(settings={"StorageOpt": {"size": str(size.bytes)}})
    return LayerPlan(size=size.bytes)


def storage_option_supported(info: Mapping[str, Any]) -> bool:
    """Whether the engine (`docker info`/Podman's compat info) can cap a layer itself.

    Overlay over XFS is what both engines' `size` storage option needs (with
    `pquota`, which only a failed create would tell; the admin's to set).
    """
    status = {str(pair[0]): str(pair[1]) for pair in info.get("DriverStatus") or [] if pair}
    driver = str(info.get("Driver", ""))
    return driver.startswith("overlay") and status.get("Backing Filesystem") == "xfs"


def layer_folder(inspected: Mapping[str, Any]) -> Path:
    """The folder of a container's writable layer, from its `inspect`.

    Raises `SessionError` when the engine does not show an overlay upper folder.
    """
    data = (inspected.get("GraphDriver") or {}).get("Data") or {}
    upper = str(data.get("UpperDir") or "")
    if not upper.startswith("/") or not upper.endswith("/diff"):
        raise SessionError(
            f"the engine shows no overlay layer for the container (GraphDriver {data}); "
            'its writable layer cannot be capped (set [limits] layer_size = "off" to run anyway)'
        )
    return Path(upper).parent


def cap_layer(folder: Path, size: int, scratch: Path, key: str) -> None:
    """Put `folder` (a created container's layer) on a filesystem of `size` bytes.

    `scratch` is a folder of gpuresa's where the backing file is made (and
    unlinked once mounted). Raises `SessionError` with the reason when any step
    fails; what was mounted is then unmounted again.
    """
    started = time.monotonic()
    if os.path.ismount(folder):
        log.debug("%s: layer %s already has its own filesystem", key, folder)
        return
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    image = scratch / f"{folder.name}.img"
    staging = Path(tempfile.mkdtemp(prefix="layer-", dir=scratch))
    try:
        with image.open("wb") as handle:
            handle.truncate(size)
        _run([*MKFS, str(image)], key)
        _run(["mount", "-o", MOUNT_OPTIONS, str(image), str(staging)], key)
        try:
            # the layer's own entries with their owners (lost+found stays beside them, unseen)
            _run(["cp", "-a", "--", f"{folder}/.", str(staging)], key)
        finally:
            _run(["umount", str(staging)], key)
        _run(["mount", "-o", MOUNT_OPTIONS, str(image), str(folder)], key)
    finally:
        with contextlib.suppress(OSError):
            image.unlink()
        with contextlib.suppress(OSError):
            staging.rmdir()
    log.info(
        "%s: writable layer capped at %d MiB (%.2f s)",
        key, size >> 20, time.monotonic() - started,
    )  # fmt: skip


def _run(command: list[str], key: str) -> None:
    try:
        subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True)
    except FileNotFoundError:
        raise SessionError(
            f"session {key}: {command[0]} is not installed; the writable layer cannot be capped "
            '(install e2fsprogs, or set [limits] layer_size = "off")'
        ) from None
    except subprocess.CalledProcessError as error:
        raise SessionError(
            f"session {key}: capping the writable layer failed: {' '.join(command[:2])}: "
            f"{(error.stderr or error.stdout or '').strip()[:300]}"
        ) from None
    except subprocess.TimeoutExpired:
        raise SessionError(
            f"session {key}: capping the writable layer: {command[0]} did not finish in "
            f"{COMMAND_TIMEOUT} s"
        ) from None
