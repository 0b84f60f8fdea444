"""Stand-in NVIDIA device nodes at the driver's own paths, for the tests of gpu_mode "devices".

`/dev` is one folder for every pytest worker, so the nodes are made and removed
under a host-wide lock: without it one worker's teardown removed the nodes a
session on another worker was being given ("host … has no /dev/nvidia1").
What looks at `/dev/nvidia*` without making nodes (a Slurm job's container)
holds the lock shared, so that none appear or vanish under it. The lock is in
a folder of root's alone: a host user can neither plant a link there nor hold
the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

FOLDER = Path("/run/gpuresa-tests")
LOCK = FOLDER / "dev-nvidia.lock"

# GPU 0 is a number no driver serves (opening it says ENXIO, where a denial says
# EPERM); GPU 1 and the control nodes are copies of /dev/null, so writes succeed.
NUMBERS = {"nvidia0": os.makedev(1, 200), "nvidia1": os.makedev(1, 3)}
NAMES = ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm")


@contextlib.contextmanager
def _locked(how: int) -> Iterator[None]:
    with contextlib.suppress(FileExistsError):
        FOLDER.mkdir(mode=0o700)
    details = FOLDER.lstat()
    assert stat.S_ISDIR(details.st_mode) and details.st_uid == 0, f"{FOLDER} is not root's"
    os.chmod(FOLDER, 0o700)
    descriptor = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(descriptor, how)
        yield
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def stand_in_gpu_nodes() -> Iterator[dict[str, int]]:
    """Make the nodes that do not exist, yield each GPU node's device number, remove ours after.

    Holds the lock throughout, so two tests that use the nodes run one after the other.
    """
    with _locked(fcntl.LOCK_EX):
        made: list[Path] = []
        try:
            for name in NAMES:
                path = Path("/dev") / name
                if path.exists():
                    continue
                os.mknod(path, 0o666 | stat.S_IFCHR, NUMBERS.get(name, os.makedev(1, 3)))
                os.chmod(path, 0o666)
                made.append(path)
            yield {name: os.stat(f"/dev/{name}").st_rdev for name in ("nvidia0", "nvidia1")}
        finally:
            for path in made:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


@contextlib.contextmanager
def gpu_nodes_left_as_they_are() -> Iterator[None]:
    """While it is held, no test makes or removes stand-in nodes."""
    with _locked(fcntl.LOCK_SH):
        yield


def stand_in_driver(folder: Path) -> tuple[str, Path]:
    """A stand-in driver in `folder` (made here): the glob of its one library, which is
    text, and its `nvidia-smi`, which names the GPUs it is shown."""
    folder.mkdir()
    (folder / "libnvidia-stand-in.so.1").write_text("not really a library\n")
    smi = folder / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "stand-in GPU $CUDA_VISIBLE_DEVICES"\n')
    smi.chmod(0o755)
    return str(folder / "libnvidia-*.so.1"), smi
