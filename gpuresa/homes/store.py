"""Each user's home that lasts from one session to the next: a capped image, shown per session.

A user's home on a host is a filesystem image of its own (`homes.images`:
`<home_root>/images/<login>.img`, capped at `[storage] home_quota`). While one
of that user's sessions runs, the image is mounted (loop, nosuid, nodev) at
`<state_dir>/homes/mounted/<login>`, and each session gets a view of it,
`<state_dir>/homes/views/<login>/<safe key>`: an idmapped bind (`homes.idmap`)
that shows the home's ids (a session's ids shifted to `paths.DISK_ID_BASE`) as
the session's own host range. The session's main container binds its view at
`/home/<login>`, so the login's `$HOME` is the lasting home: `pip --user`,
conda, git, `~/.ssh`, shell history and editors' servers land there with no
setting.

- `<state_dir>/homes` is root's, mode 0700: no host account reaches a mounted
  home or a view (not even one with the login's uid: the home's files are
  nobody's on the host);
- nosuid and nodev on the mount and on each view: a set-uid file or a device
  node made in a home does nothing, in a session or out;
- only the booking user's home is mounted in a session: another user's is
  never in its mount namespace; two sessions of one user at once each have a
  view of the same mount, so they share it;
- the image is mounted only while a view of it exists: the last session's end
  unmounts it (`detach`), and a daemon killed before that has its views
  released by the next clean-up (`release_unused`).

The image's modification time is its last use: set at each attach and
detach, read by the retention rules (`homes.retention`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from gpuresa.access import AccessError, container_uid
from gpuresa.config.sections import Config
from gpuresa.homes.idmap import IdMaps, bind_idmapped
from gpuresa.homes.images import mount_home
from gpuresa.homes.paths import (
    DISK_ID_BASE,
    LOCK_FILE,
    enabled,
    ensure_root_folder,
    home_root,
    homes_area,
    image_path,
    images_folder,
    mounted_path,
    view_path,
    view_roots,
)
from gpuresa.model import IdRange
from gpuresa.outputs.running_area import unmount
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)


@contextlib.contextmanager
def locked(config: Config) -> Iterator[None]:
    """Held while homes are mounted or unmounted: two sessions of one user start at once,
    and another installation on the same home root may mount the same image. Raises
    `OSError` when the home root is not root's alone (`paths.untrusted_folder`)."""
    area = homes_area(config)
    area.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(area, 0o700)
    # traversed (never listed) by the logins whose sessions bind their own view
    ensure_root_folder(home_root(config), 0o711)
    ensure_root_folder(images_folder(config), 0o700)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(images_folder(config) / LOCK_FILE, flags, 0o600)
    with os.fdopen(descriptor) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def reserve_view(
    config: Config, login: str, key: str, owner: tuple[int, int] | None = None
) -> Path | None:
    """Make session `key`'s (empty) view folder, which its container binds; None when homes
    are off. The home is mounted there by `attach`, once the session's ids are known.

    `owner`: the login's host uid and gid, for a session that runs as them
    (`view_path`'s `by_login`): their folder of views is root's, entered by their
    group alone (mode 0710).
    """
    if not enabled(config):
        return None
    view = view_path(config, login, key, by_login=owner is not None)
    try:
        return _reserve(config, view, owner)
    except OSError as error:
        raise SessionError(f"session {key}: {login}'s home cannot be used: {error}") from None


def _reserve(config: Config, view: Path, owner: tuple[int, int] | None) -> Path:
    with locked(config):
        if owner is not None:
            views_root = view.parent.parent
            views_root.mkdir(mode=0o711, exist_ok=True)
            os.chmod(views_root, 0o711)
            view.parent.mkdir(mode=0o710, exist_ok=True)
            if view.parent.is_symlink():
                raise SessionError(f"{view.parent} is a symbolic link; refusing to use it")
            # root's, entered by the login's group alone: the login reaches its views but
            # cannot put anything there (a link in place of a view would have the home
            # mounted wherever it points)
            os.chown(view.parent, 0, owner[1], follow_symlinks=False)
            os.chmod(view.parent, 0o710, follow_symlinks=False)
        view.mkdir(mode=0o700, parents=True, exist_ok=True)
    return view


def home_maps(ids: IdRange) -> IdMaps:
    """How a session with host range `ids` sees the homes' ids (Docker, Podman)."""
    return IdMaps.of_range(ids, DISK_ID_BASE)


def show_home(
    config: Config,
    login: str,
    key: str,
    maps: Callable[[int], IdMaps],
    owner: tuple[int, int] | None = None,
) -> None:
    """`reserve_view` and `attach` in one, for a session whose ids are known: `maps` gives
    the view's id maps from the login's uid in sessions. Raises `SessionError`."""
    view = reserve_view(config, login, key, owner)
    if view is None:
        return
    try:
        inside = container_uid(login, config.users)
    except AccessError as error:
        raise SessionError(f"session {key}: {error}") from None
    attach(config, login, key, inside, maps(inside), view)


def attach(config: Config, login: str, key: str, inside_uid: int, maps: IdMaps, view: Path) -> None:
    """Show `login`'s home at session `key`'s `view` (from `reserve_view`) through `maps`:
    the image is made at its first use (owned by `inside_uid`) and mounted if no other
    session has it.

    Idempotent (a view already mounted stays). Raises `SessionError` with the reason.
    """
    try:
        with locked(config):
            if os.path.ismount(view):
                return
            mounted = mount_home(config, login, inside_uid)
            bind_idmapped(mounted, view, maps)
            os.utime(image_path(config, login))
    except OSError as error:
        raise SessionError(f"session {key}: {login}'s home cannot be mounted: {error}") from None
    log.info("%s: %s's home %s shown at %s", key, login, image_path(config, login), view)


def views(config: Config) -> list[tuple[str, str, Path]]:
    """(login, safe key, folder) of every session's view folder, mounted or not."""
    found = []
    for root in view_roots(config):
        with contextlib.suppress(OSError):
            for login_folder in root.iterdir():
                for view in login_folder.iterdir():
                    found.append((login_folder.name, view.name, view))
    return sorted(found)


def detach(config: Config, key: str) -> None:
    """Take session `key`'s view away (its containers are gone); the home is unmounted
    when no other session of its user has a view. Logs, never raises."""
    wanted = safe_key(key)
    try:
        with locked(config):
            for login, name, view in views(config):
                if name == wanted:
                    _remove_view(config, login, view)
    except OSError as error:
        log.error("%s: its view of a home stays mounted: %s", key, error)


def _remove_view(config: Config, login: str, view: Path) -> None:
    """Unmount and remove `view`; unmount `login`'s home if it was the last (lock held)."""
    while os.path.ismount(view):
        unmount(view)
    view.rmdir()
    with contextlib.suppress(OSError):
        view.parent.rmdir()  # the login's last view there
    if any(name == login for name, _, _ in views(config)):
        return
    point = mounted_path(config, login)
    while os.path.ismount(point):
        unmount(point)
    with contextlib.suppress(OSError):
        point.rmdir()
    with contextlib.suppress(OSError):
        os.utime(image_path(config, login))
    log.info("%s's home unmounted: no session of %s runs", login, login)


def release_unused(
    config: Config, live: Callable[[], Collection[str]], min_age: float = 60.0
) -> list[str]:
    """Remove the views of gone sessions; returns what was released.

    `live` gives the keys of the sessions that exist; it is asked with the
    lock held, so a session attached meanwhile is in it (its containers exist
    before its view is mounted). A view not yet mounted is a session being
    made: kept until it is `min_age` seconds old.
    """
    released = []
    with locked(config):
        alive = {safe_key(key) for key in live()}
        for login, name, view in views(config):
            if name in alive:
                continue
            with contextlib.suppress(OSError):
                young = time.time() - view.lstat().st_mtime < min_age
                if young and not os.path.ismount(view):
                    continue
            try:
                _remove_view(config, login, view)
            except OSError as error:
                log.error("the view %s of a gone session stays: %s", view, error)
                continue
            released.append(f"home view {login}/{name}")
    return released
