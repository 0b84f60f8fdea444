"""Spare containers: a login's next session starts without unpacking its image.

`udocker create` unpacks a template's image into a new container: for the
stand-in pytorch image on a 2-core VM (a 233 MB layer, 12,100 files) 2.5 s on a
quiet machine, 10-15 s while the last session's container is removed beside it
(as after every session), minutes for a real template of several GB; a session
booked to start now waits for it. So once a login's session has come up, a spare container of the
same image is made for that login's next session, as the login, detached, at
idle CPU and I/O priority (`scripts/spare.py`); the next session takes it with
a rename (udocker's name link, well under a second) instead of unpacking.

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

from gpuresa.access import Account
from gpuresa.backends.udocker import tools
from gpuresa.config.sections import Config
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

SPARE = "gpuresa-spare-"
# a spare being made: renamed to its spare name only once it is whole
MAKING = "gpuresa-making-"
TRIES = 3


def spare_prefix(image: str) -> str:
    """The name prefix of the spares of `image` (repository:tag)."""
    return f"{SPARE}{hashlib.sha256(image.encode()).hexdigest()[:12]}-"


def spares(config: Config, login: str, image: str) -> list[str]:
    """The names of the login's spares of `image`; never waits."""
    prefix = spare_prefix(image)
    try:
        names = os.listdir(tools.repository(config, login) / "containers")
    except OSError:
        return []
    return sorted(name for name in names if name.startswith(prefix))


def take(config: Config, account: Account, image: str, name: str, key: str) -> bool:
    """Give a spare of `image` the name `name` in the login's repository; whether one was
    there to take (another session may take it first: the next is tried, up to `TRIES`)."""
    if not config.udocker.spare_containers:
        return False
    # a few tries at most: names the login made by hand cost a udocker run each
    for spare in spares(config, account.login, image)[:TRIES]:
        try:
            tools.run_udocker(config, account, ["rename", spare, name], key, 30)
        except SessionError as error:
            log.info("%s: spare %s not taken: %s", key, spare, error)
            continue
        log.info("%s: made from the login's spare container (no unpacking)", key)
        return True
    return False


def make_later(config: Config, account: Account, image: str, key: str) -> None:
    """Start the maker of the login's spare of `image` (which makes one only when the login
    has no whole one; see `scripts/spare.py`): as the login, detached, at idle priority;
    logs, never raises."""
    if not config.udocker.spare_containers:
        return
    maker = [str(config.udocker.python), str(tools.SCRIPTS / "spare.py"), image]
    idle = ["nice", "-n", "19", "ionice", "-c", "3"]
    command = [*idle, *maker, spare_prefix(image)]
    tools.start_detached(config, account, command, key, f"a spare container for {account.login}")
