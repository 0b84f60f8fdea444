"""A session as JSON for the journal, so a stop cut short by a restart can be finished."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path

from gpuresa.model import Session


def session_record(session: Session, reason: str) -> str:
    """A session and why it stops, as JSON for the journal."""
    record = {field.name: getattr(session, field.name) for field in dataclasses.fields(session)}
    record.update(
        gpu_indices=list(session.gpu_indices),
        containers=list(session.containers),
        start=session.start.isoformat(),
        end=session.end.isoformat(),
        output_dir=str(session.output_dir),
        ftp_password="",  # not needed after the end, not worth keeping
        id_range=None,  # the engine's to tell; finishing a stop does not need it
        reason=reason,
    )
    return json.dumps(record)


def session_from_record(text: str) -> tuple[Session, str]:
    """The session and reason `session_record` wrote; raises ValueError/KeyError/TypeError."""
    record = json.loads(text)
    reason = str(record.pop("reason"))
    if "gpu_indices" not in record:
        # written before the count had a name of its own: "gpus" were the indices
        record["gpu_indices"] = record["gpus"]
        record["gpu_count"] = len(record["gpus"])
    known = {field.name for field in dataclasses.fields(Session)}
    record = {name: value for name, value in record.items() if name in known}
    record.update(
        gpu_indices=tuple(record["gpu_indices"]),
        containers=tuple(record["containers"]),
        start=datetime.fromisoformat(record["start"]),
        end=datetime.fromisoformat(record["end"]),
        output_dir=Path(record["output_dir"]),
    )
    return Session(**record), reason
