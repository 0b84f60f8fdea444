"""Spare containers: a login's next session starts without unpacking its image.

`udocker create` unpacks a template's image into a new container: for the
stand-in pytorch image on a 2-core VM (a 233 MB layer, 12,100 files) 2.5 s on a
quiet machine, 10-15 s while the last session's container is removed beside it
(as after every session), minutes for a real template of several GB; a session
booked to start now waits for it. So once a login's session has come up, a
spare container of the same image is made for that login's next session
(`scripts/spare.py`), as the login, in the session's cgroup (its limits; it
ends with the session, and the next maker removes what it left half made), at
idle CPU and I/O priority; the next session takes it with a rename (udocker's
name link, well under a second) instead of unpacking.

A spare lives in the login's own repository, which the login can write, as they
can write the container made for a session between its prepare and its start
and the image it is made from: what they do to their spare reaches only their
own next session. There is at most one spare per login and image
(`[udocker] spare_containers = false` makes none); a spare of an image the
login's repository no longer holds is never taken.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuresa.access import Account
from gpuresa.backends.udocker import launch, tools
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.config.sections import Config
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

SPARE = "gpuresa-spare-"
# a spare being made: renamed to its spare name only once it is whole
MAKING = "gpuresa-making-"
TRIES = 3
# entries of a login's containers folder looked at, at most (the login can fill it)
SCAN = 10_000
# what a spare must leave free on its repository's filesystem, as a share of it
KEEP_FREE = 0.10

_takes: dict[str, threading.Lock] = {}
_takes_lock = threading.Lock()


def spare_prefix(image: str) -> str:
    """The name prefix of the spares of `image` (repository:tag)."""
    return f"{SPARE}{hashlib.sha256(image.encode()).hexdigest()[:12]}-"


def spares(config: Config, login: str, image: str) -> list[str]:
    """The names of the login's spares of `image` (as the maker names them); never waits,
    never follows a link the login put in place of their repository or its containers."""
    pattern = re.compile(re.escape(spare_prefix(image)) + r"[0-9a-f]{8}")
    try:
        repository = os.open(
            tools.repository(config, login), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        )
    except OSError:
        return []
    try:
        folder = os.open(
            "containers", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=repository
        )
    except OSError:
        return []
    finally:
        os.close(repository)
    found = []
    try:
        with os.scandir(folder) as entries:
            for index, entry in enumerate(entries):
                if index >= SCAN:
                    break
                if pattern.fullmatch(entry.name):
                    found.append(entry.name)
    finally:
        os.close(folder)
    return sorted(found)


@contextmanager
def _one_take(login: str) -> Iterator[None]:
    """One take at a time per login in this daemon: udocker's rename is no atomic claim, so
    two sessions could both take one spare, and one's end would remove the other's."""
    with _takes_lock:
        lock = _takes.setdefault(login, threading.Lock())
    with lock:
        yield


def take(config: Config, account: Account, image: str, name: str, key: str) -> bool:
    """Give a spare of `image` the name `name` in the login's repository; whether one was
    there to take (a name that does not rename is passed over: the next is tried, up to
    `TRIES`)."""
    if not config.udocker.spare_containers:
        return False
    with _one_take(account.login):
        # a few tries at most: names the login made by hand cost a udocker run each
        for spare in spares(config, account.login, image)[:TRIES]:
            try:
                tools.run_udocker(config, account, ["rename", spare, name], key, 30)
            except SessionError as error:
                log.info("%s: spare %r not taken: %s", key, spare, error)
                continue
            log.info("%s: made from the login's spare container (no unpacking)", key)
            return True
    return False


def room_for(path: Path, needed: int) -> bool:
    """Whether `needed` bytes more on `path`'s filesystem leave `KEEP_FREE` of it free."""
    try:
        disk = os.statvfs(path)
    except OSError:
        return False
    free, total = disk.f_bavail * disk.f_frsize, disk.f_blocks * disk.f_frsize
    return free - needed >= total * KEEP_FREE


def make_later(
    config: Config,
    account: Account,
    archive: tuple[Path, str] | None,
    cgroup: SessionCgroup,
    log_file: Path,
    key: str,
) -> None:
    """Start the maker of the login's spare of the image in `archive` (its file and name;
    the maker makes a spare only when the login has no whole one: see `scripts/spare.py`) in
    the session's cgroup (under its limits, and ended with it), as the login, at idle
    priority, its output in `log_file`; not where the repository's disk would keep less than
    `KEEP_FREE` with the spare (twice the archive) on it. Logs, never raises."""
    if not config.udocker.spare_containers or archive is None:
        return
    try:
        needed = 2 * archive[0].stat().st_size
    except OSError:
        return
    if not room_for(tools.repository(config, account.login), needed):
        log.info("%s: no spare container for %s: its disk is nearly full", key, account.login)
        return
    idle = ["nice", "-n", "19", "ionice", "-c", "3"]
    maker = [str(config.udocker.python), "-s", str(tools.SCRIPTS / "spare.py")]
    command = [*idle, *maker, archive[1], spare_prefix(archive[1])]
    try:
        launch.spawn(cgroup, account, command, tools.environment(config, account), log_file)
    except SessionError as error:
        log.warning("%s: no spare container made for %s: %s", key, account.login, error)
