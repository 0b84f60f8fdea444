"""Walking an output tree that its user shaped: any depth, any number of files, never a link.

A session's user decides what its output holds: a folder chain deeper than
Python's recursion limit or PATH_MAX, a million files, links to /etc, set-uid
files, file capabilities, device nodes. The walks here therefore

- keep an explicit stack (names still to visit per folder), never recurse;
- hold at most two descriptors at a time, reaching each entry through the
  descriptor of the folder that holds it and going back up through "..",
  checked to be the very folder (device and inode) it came down from;
- never follow a link: entries are looked at with lstat, changed with
  lchown, and a regular file is opened with O_NOFOLLOW when its mode must go.

They run on folders only root can reach (see `gpuresa.runtime.output_area`),
after the session's containers are gone, so nothing changes the tree under them;
the checks above keep them safe even if something did.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID
CAPABILITY_XATTR = "security.capability"

# (folder descriptor, name, lstat of the entry): what to do with an entry that is no folder
OnEntry = Callable[[int, str, os.stat_result], None]
# (descriptor of a folder whose entries are all done)
OnFolder = Callable[[int], None]
# (descriptor of the parent, name of a child folder that is done)
OnChildDone = Callable[[int, str], None]


@dataclass
class _Level:
    names: list[str]
    index: int
    # the child being visited below this level, and this level's (device, inode)
    child: str
    identity: tuple[int, int]


def _identity(details: os.stat_result) -> tuple[int, int]:
    return details.st_dev, details.st_ino


def walk(
    top: Path,
    on_entry: OnEntry,
    on_folder: OnFolder | None = None,
    on_child_done: OnChildDone | None = None,
) -> None:
    """Visit every entry below the folder `top`, depth first, post-order for folders.

    `on_entry` gets each entry that is not a folder, `on_folder` each folder
    (`top` last) once all its entries are done, `on_child_done` the parent of a
    folder after that. Entries removed meanwhile are skipped. Raises `OSError`
    when `top` is not a folder (or is a link), or when a folder is not the one
    it came down from on the way back up.
    """
    current = os.open(top, _FOLDER_FLAGS)
    try:
        stack: list[_Level] = []
        names = os.listdir(current)
        index = 0
        while True:
            if index < len(names):
                name = names[index]
                index += 1
                try:
                    details = os.stat(name, dir_fd=current, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(details.st_mode):
                    on_entry(current, name, details)
                    continue
                try:
                    child = os.open(name, _FOLDER_FLAGS, dir_fd=current)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                stack.append(_Level(names, index, name, _identity(os.fstat(current))))
                os.close(current)
                current = child
                names, index = os.listdir(current), 0
                continue
            if on_folder is not None:
                on_folder(current)
            if not stack:
                return
            level = stack.pop()
            parent = os.open("..", _FOLDER_FLAGS, dir_fd=current)
            if _identity(os.fstat(parent)) != level.identity:
                os.close(parent)
                raise OSError(errno.ESTALE, f"a folder of {top} moved during the walk")
            os.close(current)
            current = parent
            names, index = level.names, level.index
            if on_child_done is not None:
                on_child_done(current, level.child)
    finally:
        os.close(current)


def _drop_capabilities(folder: int, name: str) -> None:
    """Remove a file's capabilities (security.capability), without following a link."""
    with contextlib.suppress(OSError):
        # ENODATA (none) or ENOTSUP (a filesystem without them) both leave nothing to remove
        os.removexattr(f"/proc/self/fd/{folder}/{name}", CAPABILITY_XATTR, follow_symlinks=False)


def hand_tree(top: Path, uid: int, gid: int) -> int:
    """Give `top` and everything below to uid:gid, clearing what could grant privileges.

    Set-uid and set-gid bits go, file capabilities go, device nodes are
    removed; links are given (lchown), never followed. `top` itself is given
    last. Returns how many entries were changed; raises `OSError` when the walk
    cannot go on.
    """
    count = 0

    def entry(folder: int, name: str, details: os.stat_result) -> None:
        nonlocal count
        count += 1
        mode = details.st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
            return
        try:
            os.chown(name, uid, gid, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            return
        _drop_capabilities(folder, name)
        if mode & PRIVILEGE_BITS:
            descriptor = os.open(name, _FILE_FLAGS, dir_fd=folder)
            try:
                os.fchmod(descriptor, stat.S_IMODE(mode) & ~PRIVILEGE_BITS)
            finally:
                os.close(descriptor)

    def folder_done(folder: int) -> None:
        nonlocal count
        count += 1
        os.fchown(folder, uid, gid)
        mode = stat.S_IMODE(os.fstat(folder).st_mode)
        if mode & PRIVILEGE_BITS:
            os.fchmod(folder, mode & ~PRIVILEGE_BITS)

    walk(top, entry, folder_done)
    return count


def remove_tree(top: Path) -> None:
    """Remove the folder `top` and everything below it, at any depth; a missing `top` is fine.

    Raises `OSError` when something cannot be removed.
    """

    def entry(folder: int, name: str, _details: os.stat_result) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=folder)

    def child_done(parent: int, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(name, dir_fd=parent)

    try:
        walk(top, entry, on_child_done=child_done)
    except FileNotFoundError:
        return
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(top)
