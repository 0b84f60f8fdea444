"""Copying an output tree its user shaped out of its image: any depth, any names, no link followed.

`cp -a` builds each entry's full path, so a folder chain longer than
PATH_MAX (600 nested folders of 8 characters do it) fails with "File name
too long", and the output would stay in its image. This copy, like the walks
of `gpuresa.outputs.tree`, reaches every entry through the descriptor of the
folder that holds it, keeps an explicit stack instead of recursing, and holds
four folder descriptors at a time (the source's and the target's current
folder, and their parents while going up through "..").

What it keeps, as `cp -a` did: owners, modes (less set-uid and set-gid,
which the hand-over clears anyway), access and modification times, symbolic
links as links (never followed), hard links as links (else a file linked a
thousand times would be copied a thousand times, out of an image that held
it once), holes (a sparse file stays sparse), named pipes. Device nodes and
sockets are left out: the hand-over removes device nodes, and a socket means
nothing once its session is gone. Extended attributes are not copied (file
capabilities are cleared by the hand-over).

The source is a private mount that only root reaches and whose session is
gone, so nothing changes it during the copy; the target is a fresh folder in
the root-only store.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuresa.outputs.tree import PRIVILEGE_BITS, remove_tree

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 30


@dataclass
class _Level:
    names: list[str]
    index: int
    details: os.stat_result


def _kept_mode(details: os.stat_result) -> int:
    return stat.S_IMODE(details.st_mode) & ~PRIVILEGE_BITS


def _finish_entry(folder: int, name: str, details: os.stat_result) -> None:
    """Owner, mode (not for a link) and times of the copied entry `name` in `folder`."""
    os.chown(name, details.st_uid, details.st_gid, dir_fd=folder, follow_symlinks=False)
    if not stat.S_ISLNK(details.st_mode):
        os.chmod(name, _kept_mode(details), dir_fd=folder)
    times = (details.st_atime_ns, details.st_mtime_ns)
    os.utime(name, ns=times, dir_fd=folder, follow_symlinks=False)


def _copy_data(source: int, target: int, size: int) -> None:
    """Copy the data of `source` into the empty `target`, holes left as holes."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(source, offset, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = os.lseek(source, start, os.SEEK_HOLE)
        position = os.lseek(target, start, os.SEEK_SET)
        while position < end:
            # in the kernel, and across filesystems (copy_file_range may refuse: EXDEV)
            copied = os.sendfile(target, source, position, min(end - position, _CHUNK))
            if copied == 0:  # the file shrank: nothing changes it here, but never loop
                break
            position += copied
        offset = end
    os.ftruncate(target, size)


class _Copier:
    """One copy: the side folder of hard links seen so far, by the source's inode."""

    def __init__(self, links: int) -> None:
        self.links = links
        self.linked: set[int] = set()

    def entry(self, source: int, target: int, name: str, details: os.stat_result) -> None:
        mode = details.st_mode
        if stat.S_ISREG(mode) and details.st_nlink > 1 and details.st_ino in self.linked:
            # another name of a file already copied: a name, not a copy
            os.link(str(details.st_ino), name, src_dir_fd=self.links, dst_dir_fd=target)
            return
        if stat.S_ISREG(mode):
            self._file(source, target, name, details)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=source), name, dir_fd=target)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(name, 0o600, dir_fd=target)
        else:
            return  # device nodes and sockets: see the module docstring
        _finish_entry(target, name, details)
        if stat.S_ISREG(mode) and details.st_nlink > 1:
            os.link(name, str(details.st_ino), src_dir_fd=target, dst_dir_fd=self.links)
            self.linked.add(details.st_ino)

    @staticmethod
    def _file(source: int, target: int, name: str, details: os.stat_result) -> None:
        reading = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=source)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            writing = os.open(name, flags, 0o600, dir_fd=target)
            try:
                _copy_data(reading, writing, details.st_size)
            finally:
                os.close(writing)
        finally:
            os.close(reading)


def copy_tree(source: Path, target: Path) -> None:
    """Copy everything below the folder `source` into the new folder `target`.

    `target` must not exist; its parent must be on the filesystem where it is
    made (a side folder `.<name>.links` is made and removed there for hard
    links). Raises `OSError` when anything cannot be copied; `target` is then
    removed again, whatever was copied, so a failed copy leaves nothing but
    its source.
    """
    links_folder = target.with_name(f".{target.name}.links")
    remove_tree(links_folder)
    os.mkdir(links_folder, 0o700)
    try:
        os.mkdir(target, 0o700)
        try:
            _copy(source, target, links_folder)
        except BaseException:
            with contextlib.suppress(OSError):
                remove_tree(target)
            raise
    finally:
        remove_tree(links_folder)


def _copy(source: Path, target: Path, links_folder: Path) -> None:
    links = reading = writing = -1
    try:
        links = os.open(links_folder, _FOLDER_FLAGS)
        reading = os.open(source, _FOLDER_FLAGS)
        writing = os.open(target, _FOLDER_FLAGS)
        copier = _Copier(links)
        stack: list[_Level] = []
        details = os.fstat(reading)
        names, index = sorted(os.listdir(reading)), 0
        while True:
            if index < len(names):
                name = names[index]
                index += 1
                entry = os.stat(name, dir_fd=reading, follow_symlinks=False)
                if not stat.S_ISDIR(entry.st_mode):
                    copier.entry(reading, writing, name, entry)
                    continue
                os.mkdir(name, 0o700, dir_fd=writing)
                child_reading = os.open(name, _FOLDER_FLAGS, dir_fd=reading)
                child_writing = os.open(name, _FOLDER_FLAGS, dir_fd=writing)
                stack.append(_Level(names, index, details))
                os.close(reading)
                os.close(writing)
                reading, writing, details = child_reading, child_writing, entry
                names, index = sorted(os.listdir(reading)), 0
                continue
            # a folder whose entries are all copied: its own owner, mode and times last
            os.fchown(writing, details.st_uid, details.st_gid)
            os.fchmod(writing, _kept_mode(details))
            os.utime(writing, ns=(details.st_atime_ns, details.st_mtime_ns))
            if not stack:
                return
            level = stack.pop()
            parent_reading = os.open("..", _FOLDER_FLAGS, dir_fd=reading)
            parent_writing = os.open("..", _FOLDER_FLAGS, dir_fd=writing)
            os.close(reading)
            os.close(writing)
            reading, writing = parent_reading, parent_writing
            names, index, details = level.names, level.index, level.details
    finally:
        for descriptor in (reading, writing, links):
            if descriptor >= 0:
                os.close(descriptor)
