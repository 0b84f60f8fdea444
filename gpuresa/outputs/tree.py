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

They run on folders only root can reach (see `gpuresa.outputs.running_area`).
An output its user wrote on the host (udocker, Slurm) is moved there first,
but a process of that user may still hold a folder of it open (its working
folder) and change it during the walk. `hand_tree` is safe against that too:

- each folder is taken (root's, 0750) as soon as it is entered, before it is
  listed: from then on its entries are fixed, so the walk back up through
  ".." finds the folder it came from;
- each entry is opened once (O_PATH, never following a link) and everything
  is decided and changed through that descriptor: a name swapped meanwhile
  changes nothing but the name;
- a file with other names (hard links) may be someone else's file elsewhere:
  it is taken only when its owner is the tree's writer, else its name is
  removed from the tree and the file itself left as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ENTRY_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID
CAPABILITY_XATTR = "security.capability"
# <fcntl.h>: act on the descriptor itself (an O_PATH one, a link's included)
AT_EMPTY_PATH = 0x1000
# the modes of a handed-over tree: readable by the group, writable by nobody but root
FOLDER_MODE = 0o750
FILE_MODE = 0o640
PROGRAM_MODE = 0o750
_EXECUTABLE = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH

# (folder descriptor, name, lstat of the entry): what to do with an entry that is no folder
OnEntry = Callable[[int, str, os.stat_result], None]
# (descriptor of a folder whose entries are all done)
OnFolder = Callable[[int], None]
# (descriptor of the parent, name of a child folder that is done)
OnChildDone = Callable[[int, str], None]
# (descriptor of a folder just entered, before it is listed)
OnEnter = Callable[[int], None]


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
    on_enter: OnEnter | None = None,
) -> None:
    """Visit every entry below the folder `top`, depth first, post-order for folders.

    `on_enter` gets each folder (`top` first) as soon as it is opened, before
    it is listed; `on_entry` gets each entry that is not a folder, `on_folder` each folder
    (`top` last) once all its entries are done, `on_child_done` the parent of a
    folder after that. Entries removed meanwhile are skipped. Raises `OSError`
    when `top` is not a folder (or is a link), or when a folder is not the one
    it came down from on the way back up.
    """
    current = os.open(top, _FOLDER_FLAGS)
    try:
        stack: list[_Level] = []
        if on_enter is not None:
            on_enter(current)
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
                if on_enter is not None:
                    on_enter(current)
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


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _chown_descriptor(descriptor: int, uid: int, gid: int) -> None:
    """chown the very file (or link) `descriptor` was opened on (an O_PATH one works)."""
    if _libc.fchownat(descriptor, b"", uid, gid, AT_EMPTY_PATH) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _through(descriptor: int) -> str:
    # the descriptor's own inode by path, for the calls that take no O_PATH descriptor
    return f"/proc/self/fd/{descriptor}"


def _drop_capabilities(descriptor: int) -> None:
    """Remove a file's capabilities (security.capability) through its descriptor."""
    with contextlib.suppress(OSError):
        # ENODATA (none) or ENOTSUP (a filesystem without them) both leave nothing to remove
        os.removexattr(_through(descriptor), CAPABILITY_XATTR)


def handed_mode(mode: int) -> int:
    """The mode an entry of `mode` gets: folders and programs 0750, other files 0640."""
    if stat.S_ISDIR(mode) or mode & _EXECUTABLE:
        return PROGRAM_MODE
    return FILE_MODE


def hand_tree(top: Path, uid: int, gid: int, writer: int | None = None) -> int:
    """Give `top` and everything below to uid:gid, readable by the group, writable by uid alone.

    Folders and programs get mode 0750, other files 0640 (set-uid and set-gid
    bits go with that), file capabilities go, device nodes are removed; links
    are given, never followed. Each folder is taken as it is entered, so an
    owner still holding one open cannot change what is left (see the module
    docstring). `writer`, when given, is the only uid whose multiply-linked
    files are taken: another's is a link into the tree, whose name is removed.
    Returns how many entries were changed; raises `OSError` when the walk
    cannot go on.
    """
    count = 0

    def take(descriptor: int, details: os.stat_result) -> None:
        _chown_descriptor(descriptor, uid, gid)
        if stat.S_ISLNK(details.st_mode):
            return
        if stat.S_ISREG(details.st_mode):
            _drop_capabilities(descriptor)
        os.chmod(_through(descriptor), handed_mode(details.st_mode))

    def entry(folder: int, name: str, _listed: os.stat_result) -> None:
        nonlocal count
        try:
            descriptor = os.open(name, _ENTRY_FLAGS, dir_fd=folder)
        except FileNotFoundError:
            return
        try:
            details = os.fstat(descriptor)
            mode = details.st_mode
            count += 1
            handed = (details.st_uid, details.st_gid) == (uid, gid) and (
                stat.S_ISLNK(mode) or stat.S_IMODE(mode) == handed_mode(mode)
            )
            if handed or stat.S_ISDIR(mode):
                return  # an earlier try handed it; folders are the walk's
            # another's file with more names: a link planted into the tree, not the writer's
            foreign = writer is not None and details.st_nlink > 1 and details.st_uid != writer
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or foreign:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(name, dir_fd=folder)
                return
            take(descriptor, details)
        finally:
            os.close(descriptor)

    def enter(folder: int) -> None:
        nonlocal count
        count += 1
        os.fchown(folder, uid, gid)
        os.fchmod(folder, FOLDER_MODE)

    walk(top, entry, on_enter=enter)
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
