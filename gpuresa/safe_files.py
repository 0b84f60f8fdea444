"""Folders and files that root makes for itself or for one uid, never through a link.

Root writes keys and certificates into folders that someone else may own
(a session's host-key folder is its root's) or reach (a state directory an
admin pointed somewhere odd). A name there may be a symbolic link planted to
make root chown, chmod or overwrite a file of the attacker's choosing, so:

- a folder is opened with O_NOFOLLOW before it is chowned and chmodded, and
  the descriptor is what is changed: a link put in its place afterwards is
  not followed either;
- a file is written into a fresh name of its own (O_EXCL), given its owner
  and mode through its descriptor, then renamed over the old name: a link
  at that name is replaced, never written through;
- a file made once is linked into place, which fails when the name exists:
  the first of several makers wins and nobody overwrites another's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def private_folder(path: Path, uid: int = 0, gid: int = 0) -> Path:
    """`path` as a folder of uid:gid alone (0700), made with its parents if missing.

    Returns `path`. Raises `OSError` when `path` is a symbolic link or not a
    folder; the link's target is left as it was.
    """
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        descriptor = os.open(path, _FOLDER_FLAGS)
    except OSError as error:
        # O_NOFOLLOW on a link says ELOOP, O_DIRECTORY on anything else ENOTDIR
        what = "a symbolic link" if path.is_symlink() else "not a folder"
        raise OSError(error.errno, f"{path} is {what}") from None
    try:
        os.fchown(descriptor, uid, gid)
        os.fchmod(descriptor, 0o700)
    finally:
        os.close(descriptor)
    return path


def _fresh_file(folder: Path, data: bytes, mode: int, uid: int, gid: int) -> Path:
    """A new file in `folder` (a name of its own) holding `data`, uid:gid's, `mode`."""
    descriptor, name = tempfile.mkstemp(dir=folder, prefix=".new-")
    try:
        os.write(descriptor, data)
        os.fchown(descriptor, uid, gid)
        os.fchmod(descriptor, mode)
    except BaseException:
        os.close(descriptor)
        os.unlink(name)
        raise
    os.close(descriptor)
    return Path(name)


def replace_file(path: Path, data: bytes, mode: int = 0o600, uid: int = 0, gid: int = 0) -> None:
    """Replace `path` by a fresh file holding `data` (uid:gid, `mode`), atomically.

    A link at `path` is replaced, not followed. Safe from several threads at
    once: each writes a file of its own first, the last rename wins.
    """
    fresh = _fresh_file(path.parent, data, mode, uid, gid)
    try:
        os.replace(fresh, path)
    except BaseException:
        fresh.unlink(missing_ok=True)
        raise


def create_once(path: Path, data: bytes) -> None:
    """Make `path` (root's, 0600) holding `data` unless the name exists: the first maker wins.

    Two daemons or threads making the host's keys at once agree on one key
    instead of overwriting each other's.
    """
    fresh = _fresh_file(path.parent, data, 0o600, 0, 0)
    try:
        os.link(fresh, path)
    except FileExistsError:
        pass  # another maker was first: its file is kept
    finally:
        fresh.unlink(missing_ok=True)
