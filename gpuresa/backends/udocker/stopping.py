"""Signalling a udocker session's processes from the host: a stop's SIGTERM, a warning.

The user's processes are the members of the session's cgroup less the
session's own machinery (`launch.machinery`: udocker, runc, the container's
first process, and the listener on its port): without these the session
could not be stopped cleanly or logged into again, so no signal but the
final SIGKILL of the whole cgroup reaches them. Nothing is run in the
container and nothing in it is waited on.
"""

from __future__ import annotations

import logging
import signal
import time
from datetime import timedelta
from pathlib import Path

from gpuresa.backends.udocker import launch, listening
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.sessions.signals import catching

log = logging.getLogger(__name__)


def user_processes(cgroup: SessionCgroup, folder: Path) -> set[int]:
    """The pids of the session's cgroup that its user runs (`folder`: the session's record
    folder, where the container's and the listener's pids are kept)."""
    spared = launch.machinery(cgroup, folder, listening.recorded(cgroup, folder))
    return set(cgroup.members()) - spared


def signal_processes(key: str, cgroup: SessionCgroup, folder: Path, number: signal.Signals) -> int:
    """Send `number` to the user's processes of session `key` that catch it; how many got it.

    0 when the session's container does not run (a session prepared halfway,
    stopped or gone): nothing is sent then.
    """
    if launch.init_pid(cgroup, folder) is None:
        log.info("%s: the session's container does not run; %s sent to nobody", key, number.name)
        return 0
    # only to those with a handler: the warning must end nothing (see sessions.signals)
    sent = cgroup.signal(catching(user_processes(cgroup, folder), number), number)
    log.info("%s: %s sent to %d processes", key, number.name, sent)
    return sent


def give_grace(key: str, cgroup: SessionCgroup, folder: Path, grace: timedelta) -> None:
    """SIGTERM the user's processes of session `key`, then wait up to `grace` for them to
    end; returns as soon as none is left."""
    sent = cgroup.signal(sorted(user_processes(cgroup, folder)), signal.SIGTERM)
    log.info("%s: SIGTERM sent to %d processes; waiting up to %s", key, sent, grace)
    deadline = time.monotonic() + grace.total_seconds()
    while time.monotonic() < deadline:
        # processes started after the SIGTERM (a handler saving its work) count too
        if not user_processes(cgroup, folder):
            return
        time.sleep(launch.POLL * 2)
