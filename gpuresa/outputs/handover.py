"""What happens to a session's output at its stop: handed over read-only, dated.

Called by `Runtime.finish_stop` once the session's containers are gone (and
again, harmlessly, for a stop a daemon restart interrupted). A running output
sits in the root-only running area (`gpuresa.outputs.running_area`); it is
handed over there (made root's and read-only to the login's group, see
`gpuresa.outputs.owners`; set-uid/set-gid bits and file capabilities
cleared, device nodes removed) and only then renamed to its final place.

An output its login wrote from the host (udocker, Slurm: the login's own
folder at its final place) is first renamed into the root-only store, so
the login's shell can no longer reach it by its path, then handed over there
(`hand_tree` also holds against a process of the login's that kept a folder
of it open), then renamed back. A hand-over that fails leaves the output
where only root reaches it; `retry_pending` (each maintenance round) tries
again and says so to the admin once. A capped output that cannot be copied
out of its image stays there, recorded as an output of its own
(`OutputRecords.record_image`): listed, retried, and removed with its image
at the end of its retention.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuresa.access import AccessError, host_account
from gpuresa.config.sections import Config
from gpuresa.model import Session
from gpuresa.outputs.capped import image_path, release_capped
from gpuresa.outputs.folder import hand_over
from gpuresa.outputs.owners import HANDED_UID, output_owner, prepare_login_folder
from gpuresa.outputs.records import OutputRecords, image_relative
from gpuresa.outputs.running_area import (
    AREA_MODE,
    Pending,
    forget,
    pending,
    remember,
    running_path,
    store,
    stored_path,
)

log = logging.getLogger(__name__)

# (key, why) -> None: how a failed hand-over reaches the admin (deduplicated by key)
Report = Callable[[str, str], None]


def finish_output(config: Config, session: Session, now: datetime | None = None) -> bool:
    """Hand `session`'s output over read-only to its login and start its retention.

    Returns whether the output is in its final place. Logs, never raises: a
    stop must finish whatever happens to its output.
    """
    stored = stored_path(config, session.key)
    item = Pending(session.key, session.user, stored, session.output_dir)
    return _finish(config, item, now or datetime.now(UTC)) is None


def retry_pending(
    config: Config,
    live_keys: Collection[str],
    report: Report,
    now: datetime | None = None,
    *,
    settle: timedelta = timedelta(0),
) -> int:
    """Finish every output left in the running area whose session is gone; returns how many.

    `settle`: outputs whose record is younger are left alone (the daemon's
    view of its sessions may predate a session being made right now, whose
    record is written before its containers show). A failure is passed to
    `report` (the caller tells the admin once per key).
    """
    finished = 0
    moment = now or datetime.now(UTC)
    for item in pending(config):
        if item.key in live_keys:
            continue
        if settle and time.time() - item.written < settle.total_seconds():
            continue
        problem = _finish(config, item, moment)
        if problem is None:
            finished += 1
        else:
            report(item.key, problem)
    return finished


def _finish(config: Config, item: Pending, now: datetime) -> str | None:
    """Hand `item` over and move it to its final place; returns what went wrong, or None."""
    key, final = item.key, item.final
    try:
        # a capped output is first copied out of its image into its folder
        release_capped(config, key, running_path(config, key), item.folder)
    except OSError as error:
        log.error("%s: output stays in its image (root-only): %s", key, error)
        image = image_path(config, key)
        if image.is_file():
            # listed, and removed with its image at the end of its retention, even if
            # no copy ever succeeds
            try:
                _records(config).record_image(key, item.user, image, now)
            except OSError as record_error:
                log.error("%s: could not record the output in %s: %s", key, image, record_error)
        return f"it cannot be copied out of its image: {error}"
    # a copy that failed before succeeded now: the output is an ordinary folder again
    with contextlib.suppress(OSError):
        _records(config).forget(image_relative(key))
    source = item.folder if item.folder.is_dir() and not item.folder.is_symlink() else final
    if not source.is_dir() or source.is_symlink():
        log.warning("%s: output folder %s is gone; nothing to hand over", key, final)
        forget(config, key)
        return None
    try:
        owner = output_owner(item.user, config)
        prepare_login_folder(config, owner)
    except (AccessError, OSError) as error:
        log.error("%s: output %s stays where only root reaches it: %s", key, source, error)
        return f"its owner cannot be set up: {error}"
    writer = item.writer
    if source == final:
        try:
            source, writer = _take_away(config, item)
        except OSError as error:
            log.error("%s: output %s cannot be moved out of reach: %s", key, final, error)
            return f"it cannot be moved out of its login's reach: {error}"
    if not hand_over(source, HANDED_UID, owner.gid, key, writer):
        return f"the hand-over of {source} to group {owner.gid} failed (see the log)"
    if source != final:
        try:
            final = _free_name(final)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(source, final)
        except OSError as error:
            log.error("%s: output stays in %s: cannot move it to %s: %s", key, source, final, error)
            return f"it cannot be moved to {final}: {error}"
    forget(config, key)
    _record_end(config, item, final, now)
    return None


def _take_away(config: Config, item: Pending) -> tuple[Path, int | None]:
    """Rename the login's own output at its final place into the root-only store.

    Its record is written first, so a hand-over that fails there is retried.
    Returns its folder in the store and its writer (the login's host uid).
    Raises `OSError` when it cannot be moved (it then stays where it was).
    """
    account = host_account(item.user)
    writer = account.uid if account is not None else None
    folder = store(config)
    folder.mkdir(mode=AREA_MODE, parents=True, exist_ok=True)
    details = folder.lstat()
    if (details.st_uid, stat.S_IMODE(details.st_mode)) != (0, AREA_MODE) or folder.is_symlink():
        raise OSError(errno.EPERM, f"{folder} is not a root-only folder")
    moved = stored_path(config, item.key)
    remember(config, item.key, item.user, item.final, writer)
    os.rename(item.final, moved)
    log.info("%s: output %s moved out of its login's reach for the hand-over", item.key, moved)
    return moved, writer


def _free_name(final: Path) -> Path:
    """`final`, or `final-2`, `final-3`… when an output is already there."""
    candidate, number = final, 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = final.with_name(f"{final.name}-{number}")
    return candidate


def _records(config: Config) -> OutputRecords:
    return OutputRecords(config.daemon.state_dir / "outputs")


def _record_end(config: Config, item: Pending, final: Path, now: datetime) -> None:
    try:
        relative = final.relative_to(config.storage.output_root).as_posix()
    except ValueError:
        log.warning("%s: output %s is outside the output root; no retention", item.key, final)
        return
    try:
        _records(config).record_end(relative, item.user, item.key, now)
    except OSError as error:
        log.error("%s: could not record the end of output %s: %s", item.key, final, error)
