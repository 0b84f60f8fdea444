"""What a udocker session is given of the host's GPUs: device nodes and driver files.

udocker's runc mode gives a container the device nodes it is told to; the
session's devices cgroup then denies every other NVIDIA node, so a process
that finds one (through `/proc`, a bind, a node it makes) still cannot open
it. The driver's libraries are bound as folders, udocker binds no single file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Collection
from pathlib import Path, PurePosixPath

from gpuresa.backends.udocker import tools

# the nodes every container has: never denied, whatever a GPU node's number is
CONTAINER_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def denied_devices(given: Collection[dict[str, str]]) -> list[tuple[str, int, int]]:
    """The (type, major, minor) of the host's NVIDIA nodes a session is not given.

    Every `/dev/nvidia*` when it has no GPUs, else each `/dev/nvidia<N>` of a GPU
    it did not book. The session's devices cgroup denies them, so no process of
    it opens another GPU, whatever node it finds. A number also borne by a node
    the session is given, or by one every container has, is never denied.
    """
    paths = {device["PathOnHost"] for device in given}
    kept = set()
    for path in [*paths, *(f"/dev/{name}" for name in CONTAINER_NODES)]:
        with contextlib.suppress(OSError):
            kept.add(os.stat(path).st_rdev)
    denied = []
    for node in sorted(Path("/dev").glob("nvidia*")):
        if str(node) in paths or (paths and not node.name[len("nvidia") :].isdigit()):
            continue
        try:
            details = os.stat(node)
        except OSError:
            continue
        if stat.S_ISCHR(details.st_mode) and details.st_rdev not in kept:
            rdev = details.st_rdev
            denied.append(("c", os.major(rdev), os.minor(rdev)))
    return denied


def driver_volumes(root: Path, mounts: list[dict[str, object]]) -> list[tuple[str, str, bool]]:
    """The driver's files (`mounts`, as given to an engine), copied once per host into
    folders under the udocker folder `root`; (folder, target, read-only) to bind."""
    volumes: dict[str, str] = {}
    for mount in mounts:
        source, target = Path(str(mount["Source"])), PurePosixPath(str(mount["Target"]))
        folder = root / "driver" / target.parent.name
        tools.ensure_folder(folder)
        copy = folder / source.name
        details = source.stat()
        if not copy.exists() or copy.stat().st_size != details.st_size:
            shutil.copy2(source, copy)
        volumes[str(folder)] = str(target.parent)
    return [(source, target, True) for source, target in volumes.items()]
