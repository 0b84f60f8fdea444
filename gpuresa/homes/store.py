"""Each user's home that lasts from one session to the next: a capped image, shown per session.

A user's home on a host is a filesystem image of its own,
`<home_root>/<login>.img` (root's, in a root-only folder; sparse,
`[storage] home_quota` bytes, ext4 with no blocks kept for root), so a full
home gives ENOSPC to that user alone and never fills the disk under anyone
else. Its files keep the ids the sessions
see: the login's own uid, root as 0.

While one of that user's sessions runs, the image is mounted (loop, nosuid,
nodev) at `<state_dir>/homes/mounted/<login>`, and each session gets a view of
it, `<state_dir>/homes/views/<login>/<safe key>`: an idmapped bind
(`homes.idmap`) that shows the home's ids as the session's own host range.
The session's main container binds its view at `/home/<login>`, so the
login's `$HOME` is the lasting home: `pip --user`, conda, git, `~/.ssh`,
shell history and editors' servers land there with no setting.

- `<state_dir>/homes` is root's, mode 0700: no host account reaches a mounted
  home or a view (a host user with the login's uid included: its files are
  the session's ids, not host ones);
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
import shutil
import subprocess
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path, PurePosixPath

from gpuresa.access import AccessError, container_uid
from gpuresa.config.sections import Config
from gpuresa.homes.idmap import IdMaps, bind_idmapped
from gpuresa.outputs.capped import run_tool
from gpuresa.outputs.running_area import unmount
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)

HOMES_FOLDER = "homes"
MOUNTED_FOLDER = "mounted"
VIEWS_FOLDER = "views"
LOGIN_VIEWS_FOLDER = ".views"
LOCK_FILE = ".lock"
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime"
# mkfs of a sparse image: no blocks kept for root, no discard pass, tables zeroed lazily
MKFS = ("mkfs.ext4", "-q", "-F", "-m", "0")
MKFS_EXTENDED = "lazy_itable_init=1,lazy_journal_init=1,nodiscard"
SKELETON = Path("/etc/skel")
TIMEOUT = 120.0


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


def image_path(config: Config, login: str) -> Path:
    return home_root(config) / f"{login}.img"


def homes_area(config: Config) -> Path:
    """`<state_dir>/homes`: root's, 0700; the mounted homes and their views are below it."""
    return config.daemon.state_dir / HOMES_FOLDER


def mounted_path(config: Config, login: str) -> Path:
    return homes_area(config) / MOUNTED_FOLDER / login


def view_path(config: Config, login: str, key: str, *, by_login: bool = False) -> Path:
    """Session `key`'s view of `login`'s home: what its main container binds.

    `by_login`: for a session that runs as the login's host account (udocker),
    whose own tools bind the view: in `<home_root>/.views/<login>`, root's, which
    the login's group enters (mode 0710) and nobody else, in a folder only root
    lists.
    """
    if by_login:
        return home_root(config) / LOGIN_VIEWS_FOLDER / login / safe_key(key)
    return homes_area(config) / VIEWS_FOLDER / login / safe_key(key)


def _view_roots(config: Config) -> tuple[Path, Path]:
    return homes_area(config) / VIEWS_FOLDER, home_root(config) / LOGIN_VIEWS_FOLDER


@contextlib.contextmanager
def locked(config: Config) -> Iterator[None]:
    """Held while homes are mounted or unmounted: two sessions of one user start at once,
    and another installation on the same home root may mount the same image."""
    area = homes_area(config)
    area.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(area, 0o700)
    root = home_root(config)
    # traversed (never listed) by the logins whose sessions bind their own view
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(root, 0o711)
    descriptor = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
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
            mounted = _mount_home(config, login, inside_uid)
            bind_idmapped(mounted, view, maps)
            os.utime(image_path(config, login))
    except OSError as error:
        raise SessionError(f"session {key}: {login}'s home cannot be mounted: {error}") from None
    log.info("%s: %s's home %s shown at %s", key, login, image_path(config, login), view)


def _mount_home(config: Config, login: str, inside_uid: int) -> Path:
    """`login`'s home mounted (made first if new); its mount point."""
    point = mounted_path(config, login)
    if os.path.ismount(point):
        return point
    image = image_path(config, login)
    made = not image.exists()
    if made:
        _make_image(config, image, inside_uid)
    point.mkdir(mode=0o700, parents=True, exist_ok=True)
    holders = _loop_devices_of(image)
    if holders:
        # mounted twice through two loop devices, one filesystem would be written by two
        # kernels' views of it and be damaged: another installation (or a mount left by
        # hand) has it
        raise OSError(f"{image} is in use elsewhere ({', '.join(holders)})")
    try:
        run_tool("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(point))
        if made:
            _first_files(point, inside_uid)
    except OSError:
        if made:
            with contextlib.suppress(OSError):
                unmount(point)
            image.unlink(missing_ok=True)
        raise
    return point


def _loop_devices_of(image: Path) -> list[str]:
    """The loop devices backed by `image` (`losetup -j`)."""
    try:
        result = subprocess.run(
            ["losetup", "-j", str(image)], capture_output=True, text=True, timeout=TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OSError(f"losetup: {error}") from None
    return [line.split(":", 1)[0] for line in result.stdout.splitlines() if line.strip()]


def _make_image(config: Config, image: Path, inside_uid: int) -> None:
    quota = config.storage.home_quota
    assert quota != "off"
    image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(descriptor, quota.bytes)
    finally:
        os.close(descriptor)
    try:
        owner = f"root_owner={inside_uid}:{inside_uid}"
        run_tool(*MKFS, "-E", f"{MKFS_EXTENDED},{owner}", str(image))
    except OSError:
        image.unlink(missing_ok=True)
        raise
    log.info("home image %s made (%d bytes, sparse)", image, quota.bytes)


def _first_files(home: Path, inside_uid: int, inside_gid: int | None = None) -> None:
    """A new home: no lost+found in the user's way, the host's shell start files."""
    gid = inside_uid if inside_gid is None else inside_gid
    with contextlib.suppress(OSError):
        (home / "lost+found").rmdir()
    with contextlib.suppress(OSError):
        for entry in SKELETON.iterdir():
            if entry.is_file() and not entry.is_symlink():
                copy = home / entry.name
                shutil.copyfile(entry, copy, follow_symlinks=False)
                os.chown(copy, inside_uid, gid, follow_symlinks=False)
    os.chmod(home, 0o750)


def views(config: Config) -> list[tuple[str, str, Path]]:
    """(login, safe key, folder) of every session's view folder, mounted or not."""
    found = []
    for root in _view_roots(config):
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


def folder_home(config: Config, root: Path, login: str, owner: tuple[int, int]) -> Path | None:
    """`login`'s lasting home as a plain folder `<root>/homes/<login>`, theirs (mode 0700),
    for sessions on other machines that see `root` (a cluster's shared folder): a mount
    made here would not reach them. Made with the shell's start files at its first use;
    None when homes are off. Not capped here: a quota of the shared filesystem caps it.
    Its modification time is its last use, as for an image."""
    if not enabled(config):
        return None
    parent = root / HOMES_FOLDER
    parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(parent, 0o711)
    home = parent / login
    try:
        home.mkdir(mode=0o700)
    except FileExistsError:
        if home.is_symlink() or not home.is_dir():
            raise SessionError(f"{home} is not a folder; refusing to use it") from None
    else:
        _first_files(home, owner[0], owner[1])
        os.chmod(home, 0o700)
    os.chown(home, *owner, follow_symlinks=False)
    os.utime(home, follow_symlinks=False)
    return home
