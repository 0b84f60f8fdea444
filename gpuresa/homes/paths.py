"""Where the homes live, which folders hold them, and the checks that they are root's.

- `<home_root>` (root's, 0711: traversed, never listed, by the logins whose
  sessions bind their own view) holds `images/` and `.views/`;
- `<home_root>/images` (root's, 0700): each login's image `<login>.img`
  (root's, 0600, one link), the notices sent, and the homes' lock;
- `<home_root>/.views/<login>` (root's, group the login's, 0710): the views of
  sessions that run as the login's host account (udocker);
- `<state_dir>/homes` (root's, 0700): the mounted homes (`mounted/<login>`)
  and the views of containers' sessions (`views/<login>/<safe key>`).

Every folder from `/` down to `home_root` must be root's and writable by no
one else (a world-writable one only with its sticky bit, as /tmp is): a
`home_root` a user could make or replace first would give them the images
gpuresa mounts as other users' homes.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path, PurePosixPath

from gpuresa.config.sections import Config
from gpuresa.sessions.labels import safe_key

HOMES_FOLDER = "homes"
IMAGES_FOLDER = "images"
MOUNTED_FOLDER = "mounted"
VIEWS_FOLDER = "views"
LOGIN_VIEWS_FOLDER = ".views"
LOCK_FILE = ".lock"
# the ids a home keeps on disk: a session's ids 0-65535 from here, so that no file of a
# home is root's or any host account's if an image is ever mounted outside a view
DISK_ID_BASE = 1_600_000_000


def enabled(config: Config) -> bool:
    """Whether sessions get a lasting home (`[storage] home_quota` is not "off")."""
    return config.storage.home_quota != "off"


def home_target(login: str) -> PurePosixPath:
    """Where the home appears in a session: the login's `$HOME`."""
    return PurePosixPath("/home") / login


def home_root(config: Config) -> Path:
    """`[storage] home_root`, or "homes" beside the output root when unset."""
    storage = config.storage
    return storage.home_root or storage.output_root.parent / "homes"


def images_folder(config: Config) -> Path:
    return home_root(config) / IMAGES_FOLDER


def image_path(config: Config, login: str) -> Path:
    return images_folder(config) / f"{login}.img"


def homes_area(config: Config) -> Path:
    """`<state_dir>/homes`: root's, 0700; the mounted homes and their views are below it."""
    return config.daemon.state_dir / HOMES_FOLDER


def mounted_path(config: Config, login: str) -> Path:
    return homes_area(config) / MOUNTED_FOLDER / login


def view_path(config: Config, login: str, key: str, *, by_login: bool = False) -> Path:
    """Session `key`'s view of `login`'s home: what its main container binds.

    `by_login`: for a session that runs as the login's host account (udocker),
    whose own tools bind the view: in `<home_root>/.views/<login>`, root's, which
    the login's group enters (mode 0710) and nobody else; the home's own folder
    is its user's alone (0700).
    """
    if by_login:
        return home_root(config) / LOGIN_VIEWS_FOLDER / login / safe_key(key)
    return homes_area(config) / VIEWS_FOLDER / login / safe_key(key)


def view_roots(config: Config) -> tuple[Path, Path]:
    return homes_area(config) / VIEWS_FOLDER, home_root(config) / LOGIN_VIEWS_FOLDER


def untrusted_folder(path: Path) -> str | None:
    """Why `path` or a folder above it could be made or replaced by someone but root, or
    None when each that exists is root's and writable by no one else (sticky aside)."""
    for folder in (*reversed(path.parents), path):
        try:
            details = folder.lstat()
        except FileNotFoundError:
            return None  # made by root below here
        if stat.S_ISLNK(details.st_mode):
            with contextlib.suppress(OSError):
                details = folder.stat()  # a link of root's (/var/run): what it names
        if not stat.S_ISDIR(details.st_mode):
            return f"{folder} is not a folder"
        if details.st_uid != 0:
            return f"{folder} is not root's (uid {details.st_uid})"
        open_to_others = details.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        # a sticky folder (/tmp) lets no one replace root's entries: its next one is checked
        if open_to_others and (folder == path or not details.st_mode & stat.S_ISVTX):
            return f"{folder} is writable by others than root"
    return None


def ensure_root_folder(path: Path, mode: int) -> None:
    """Make `path` a folder of root's with `mode`; `OSError` when it or a folder above it
    is not root's alone (`untrusted_folder`)."""
    problem = untrusted_folder(path)
    if problem is not None:
        raise OSError(f"{problem}: refusing to keep homes there")
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    details = path.lstat()
    if not stat.S_ISDIR(details.st_mode) or details.st_uid != 0:
        raise OSError(f"{path} is not a folder of root's: refusing to keep homes there")
    os.chmod(path, mode, follow_symlinks=False)
