"""What happens to a session's output at its stop: handed to its login's owner, dated.

Called by `Runtime.finish_stop` once the session's containers are gone (and
again, harmlessly, for a stop a daemon restart interrupted).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from gpuresa.access import AccessError
from gpuresa.config.sections import Config
from gpuresa.model import Session
from gpuresa.outputs.owners import output_owner, prepare_login_folder
from gpuresa.outputs.records import OutputRecords
from gpuresa.runtime.output import hand_over

log = logging.getLogger(__name__)


def finish_output(config: Config, session: Session, now: datetime | None = None) -> None:
    """Hand `session`'s output folder to its login's stable owner and start its retention.

    Logs, never raises: a stop must finish whatever happens to its output.
    """
    key = session.key
    path = session.output_dir
    if not path.is_dir() or path.is_symlink():
        log.warning("%s: output folder %s is gone; nothing to hand over", key, path)
        return
    try:
        owner = output_owner(session.user, config)
        prepare_login_folder(config, owner)
    except (AccessError, OSError) as error:
        log.error("%s: output %s stays with the session's uid: %s", key, path, error)
        return
    hand_over(path, owner.uid, owner.gid, key)
    try:
        relative = path.relative_to(config.storage.output_root).as_posix()
    except ValueError:
        log.warning("%s: output %s is outside the output root; no retention", key, path)
        return
    records = OutputRecords(config.daemon.state_dir / "outputs")
    try:
        records.record_end(relative, session.user, key, now or datetime.now(UTC))
    except OSError as error:
        log.error("%s: could not record the end of output %s: %s", key, path, error)
