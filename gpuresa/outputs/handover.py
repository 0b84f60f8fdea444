"""What happens to a session's output at its stop: handed to its login's owner, dated.

Called by `Runtime.finish_stop` once the session's containers are gone (and
again, harmlessly, for a stop a daemon restart interrupted). A running output
sits in the root-only running area (`gpuresa.runtime.output_area`); it is
handed over there (owner changed, set-uid/set-gid bits and file capabilities
cleared, device nodes removed) and only then renamed to its final place. A
hand-over that fails leaves it where only root reaches it; `retry_pending`
(each maintenance round) tries again and says so to the admin once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path

from gpuresa.access import AccessError
from gpuresa.config.sections import Config
from gpuresa.model import Session
from gpuresa.outputs.capped import release_capped
from gpuresa.outputs.owners import output_owner, prepare_login_folder
from gpuresa.outputs.records import OutputRecords
from gpuresa.runtime.output import hand_over
from gpuresa.runtime.output_area import Pending, forget, pending, running_path, stored_path

log = logging.getLogger(__name__)

# (key, why) -> None: how a failed hand-over reaches the admin (deduplicated by key)
Report = Callable[[str, str], None]


def finish_output(config: Config, session: Session, now: datetime | None = None) -> bool:
    """Hand `session`'s output to its login's stable owner and start its retention.

    Returns whether the output is in its final place. Logs, never raises: a
    stop must finish whatever happens to its output.
    """
    stored = stored_path(config, session.key)
    item = Pending(session.key, session.user, stored, session.output_dir)
    return _finish(config, item, now or datetime.now(UTC)) is None


def retry_pending(
    config: Config, live_keys: Collection[str], report: Report, now: datetime | None = None
) -> int:
    """Finish every output left in the running area whose session is gone; returns how many.

    A failure is passed to `report` (the caller tells the admin once per key).
    """
    finished = 0
    for item in pending(config):
        if item.key in live_keys:
            continue
        problem = _finish(config, item, now or datetime.now(UTC))
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
        return f"it cannot be copied out of its image: {error}"
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
    if not hand_over(source, owner.uid, owner.gid, key):
        return f"the hand-over of {source} to uid {owner.uid} failed (see the log)"
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


def _free_name(final: Path) -> Path:
    """`final`, or `final-2`, `final-3`… when an output is already there."""
    candidate, number = final, 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = final.with_name(f"{final.name}-{number}")
    return candidate


def _record_end(config: Config, item: Pending, final: Path, now: datetime) -> None:
    try:
        relative = final.relative_to(config.storage.output_root).as_posix()
    except ValueError:
        log.warning("%s: output %s is outside the output root; no retention", item.key, final)
        return
    records = OutputRecords(config.daemon.state_dir / "outputs")
    try:
        records.record_end(relative, item.user, item.key, now)
    except OSError as error:
        log.error("%s: could not record the end of output %s: %s", item.key, final, error)
