"""The one thing Docker labels cannot say about a session: a moved end time.

Labels are fixed when a container is made, so an extended session's end is
kept in `<state_dir>/sessions/<key>.json`.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key, utc_text

log = logging.getLogger(__name__)


class EndRecords:
    """Moved end times, one small JSON file per session in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory / f"{safe_key(key)}.json"

    def recorded(self, key: str) -> datetime | None:
        try:
            record = json.loads(self.path(key).read_text(encoding="utf-8"))
            if record.get("key") != key:
                return None
            return datetime.fromisoformat(record["end"]).astimezone(UTC)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("%s: ignoring unreadable record %s: %s", key, self.path(key), error)
            return None

    def record(self, key: str, end: datetime) -> None:
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"key": key, "end": utc_text(end)}) + "\n")
            os.replace(temporary, path)
        except OSError as error:
            raise SessionError(
                f"cannot record the new end of session {key} in {path}: {error}"
            ) from None

    def forget(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("%s: cannot remove %s: %s", key, self.path(key), error)
