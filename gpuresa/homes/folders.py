"""A login's lasting home as a plain folder, for sessions on other machines (Slurm's nodes).

A mount made on the daemon's machine would not reach a job's node, so there
the home is `<root>/homes/<login>` on the shared folder the nodes see: the
login's, mode 0700. Not capped by gpuresa (a quota of the shared filesystem
caps it). A new one is filled while it is still root's alone, under a name
of its own (`.<login>.new`), and only then given to the login and renamed
into place, under a lock: a login never owns a folder root is still writing
in, so no link of theirs can take root's writes elsewhere.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from pathlib import Path

from gpuresa.config.sections import Config
from gpuresa.homes.images import first_files
from gpuresa.homes.paths import HOMES_FOLDER, LOCK_FILE, enabled, ensure_root_folder
from gpuresa.sessions.errors import SessionError


def folder_home(config: Config, root: Path, login: str, owner: tuple[int, int]) -> Path | None:
    """`login`'s home `<root>/homes/<login>`, made with the shell's start files at its first
    use, the login's (`owner`: uid, gid), its time set to now (its last use). None when
    homes are off; `SessionError` when it cannot be used."""
    if not enabled(config):
        return None
    parent = root / HOMES_FOLDER
    home = parent / login
    try:
        ensure_root_folder(parent, 0o711)
        descriptor = os.open(parent / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.lexists(home):
                _make(home, owner)
            details = home.lstat()
            if not stat.S_ISDIR(details.st_mode):
                raise OSError(f"{home} is not a folder")
            # `homes` is root's: the folder named here is the one checked above
            os.chown(home, *owner, follow_symlinks=False)
            os.utime(home, follow_symlinks=False)
    except OSError as error:
        raise SessionError(f"{login}'s home {home} cannot be used: {error}") from None
    return home


def _make(home: Path, owner: tuple[int, int]) -> None:
    """Fill a new home aside (root's alone meanwhile), then give it and rename it in place."""
    fresh = home.with_name(f".{home.name}.new")
    shutil.rmtree(fresh, ignore_errors=True)  # a daemon killed while it made one
    fresh.mkdir(mode=0o700)
    first_files(fresh, owner[0], owner[1], mode=0o700)
    os.chown(fresh, *owner, follow_symlinks=False)
    os.rename(fresh, home)
