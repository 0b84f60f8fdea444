"""A session's output folder on the host: where it is, who owns it, who gets it after.

In a user namespace the container's uid U is uid `base + U` on the host (one
base for every Docker session under `userns-remap`, one per session on
Podman, see `engines`), so the folder is given to that remapped uid: the
session's login (over SSH) and the FTP sidecar (same uid) can write it, and
nobody else on the host but root can. After the session it is handed over
read-only: root's, readable by the login's group (see `gpuresa.outputs.owners`).
Symbolic links are never followed: the user controls what is inside.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from gpuresa.config.sections import Config
from gpuresa.model import SessionSpec
from gpuresa.outputs.tree import hand_tree
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)

OUTPUT_MODE = 0o750


def remap_base(info: Mapping[str, Any]) -> tuple[int, int]:
    """The host uid and gid that root in a container maps to, from `docker info`.

    With `userns-remap` the engine keeps its data in `<root>/<uid>.<gid>` (for
    example `/var/lib/docker/100000.100000`); without user namespaces both are 0.
    """
    options = " ".join(str(option) for option in info.get("SecurityOptions") or [])
    if "name=userns" not in options:
        return 0, 0
    suffix = Path(str(info.get("DockerRootDir", ""))).name
    uid_text, _, gid_text = suffix.partition(".")
    if not (uid_text.isdigit() and gid_text.isdigit()):
        raise SessionError(
            f"the Docker engine uses user namespaces but its root dir {suffix!r} does not "
            "name the remapped uid and gid"
        )
    return int(uid_text), int(gid_text)


def output_path(config: Config, spec: SessionSpec) -> Path:
    """Where a session's output is kept: `<output_root>/<output_pattern>`.

    The pattern gets {user}, {key} (made safe for paths), {host}, {template}
    and {start} (in the site's time zone). Raises `SessionError` for a pattern
    that names anything else or leads outside the output root.
    """
    storage = config.storage
    start = spec.start.astimezone(ZoneInfo(config.reservations.timezone))
    try:
        relative = storage.output_pattern.format(
            user=spec.user,
            key=safe_key(spec.key),
            host=spec.host,
            template=spec.template,
            start=start,
        )
    except (KeyError, IndexError, ValueError, AttributeError) as error:
        raise SessionError(
            f"storage.output_pattern {storage.output_pattern!r} cannot be filled in: {error}"
        ) from None
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or any(part in ("..", ".") for part in parts):
        raise SessionError(
            f"storage.output_pattern gives {relative!r} for session {spec.key}, "
            "which is not a relative path below output_root"
        )
    return storage.output_root / relative


def _give_tree(top: Path, uid: int, gid: int) -> None:
    """Give `top` and everything below it to uid:gid, never following a link, at any depth.

    See `gpuresa.outputs.tree.hand_tree` (privilege bits and capabilities are
    cleared on the way). Raises `OSError` when `top` is not a folder or cannot be changed.
    """
    hand_tree(top, uid, gid)


def take_back(final: Path, running: Path, key: str) -> None:
    """Move an earlier try's output (in its final place) back to the running area.

    A session made again keeps its files; they go back out of reach of the host
    before its containers mount them. Nothing happens when there is none or
    the running folder already exists. Raises `SessionError` when it cannot be moved.
    """
    try:
        if running.exists() or running.is_symlink() or not final.is_dir() or final.is_symlink():
            return
        os.rename(final, running)
    except OSError as error:
        raise SessionError(f"cannot move {final} back to {running}: {error}") from None
    log.info("%s: output %s taken back for the session", key, final)


def make_output_folder(path: Path) -> None:
    """Make the output folder (mode 0750, root's) if it is not there; an existing one is kept.

    The engine needs the folder to exist before it creates the containers that
    mount it; `prepare_output` gives it to the session once its ids are known.
    Raises `SessionError` when it cannot be made or is a link.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            raise SessionError(f"output folder {path} is a symbolic link; refusing to use it")
        path.mkdir(mode=OUTPUT_MODE, exist_ok=True)
    except OSError as error:
        raise SessionError(f"cannot make output folder {path}: {error}") from None


def prepare_output(path: Path, uid: int, gid: int, key: str) -> None:
    """Make the output folder and give it (and anything in it) to uid:gid on the host.

    An existing folder is kept with its files (a session made again, or its
    user's second try); its files are given back to the session's uid when an
    earlier hand-over gave them away. Raises `SessionError` when the folder is
    a link or cannot be made or given (gpuresa must run as root).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            raise SessionError(f"output folder {path} is a symbolic link; refusing to use it")
        try:
            path.mkdir(mode=OUTPUT_MODE)
            created = True
        except FileExistsError:
            created = False
        details = path.lstat()
        if not stat.S_ISDIR(details.st_mode):
            raise SessionError(f"output folder {path} exists and is not a folder")
        if created or (details.st_uid, details.st_gid) == (uid, gid):
            os.lchown(path, uid, gid)
        else:
            log.info("%s: giving the files in %s back to uid %d", key, path, uid)
            _give_tree(path, uid, gid)
        os.chmod(path, OUTPUT_MODE)
    except PermissionError as error:
        raise SessionError(
            f"cannot prepare output folder {path} for uid {uid}: {error.strerror} "
            "(gpuresa must run as root to give it to the container's remapped uid)"
        ) from None
    except OSError as error:
        raise SessionError(f"cannot prepare output folder {path}: {error}") from None
    log.info("%s: output folder %s (host uid %d)", key, path, uid)


def hand_over(path: Path, uid: int, gid: int, key: str, writer: int | None = None) -> bool:
    """Give a finished session's output to uid:gid, read-only to the group; logs, never raises.

    `writer`: see `gpuresa.outputs.tree.hand_tree`. Returns whether every
    entry was handed over (privilege bits cleared).
    """
    try:
        count = hand_tree(path, uid, gid, writer)
    except OSError as error:
        log.error("%s: could not hand %s to %d:%d: %s", key, path, uid, gid, error)
        return False
    log.info("%s: output %s handed to %d:%d, read-only (%d entries)", key, path, uid, gid, count)
    return True
