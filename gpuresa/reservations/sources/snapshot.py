"""The last good copy of a calendar on disk, so a restart does not need the server.

One JSON file per calendar, `<state_dir>/calendars/<name>/snapshot.json`,
replaced atomically (write, fsync, rename): a crash leaves the old or the new
copy, never half of one. It records where the copy came from, so a calendar
whose URL changed in the config starts afresh. `Changes` says what one poll
changed in the copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = 1
SNAPSHOT_FILE = "snapshot.json"
SUCCESS_FILE = "last-success"


@dataclass
class StoredObject:
    """One calendar object: its data and the validator (ETag) it came with."""

    data: bytes
    etag: str | None = None


@dataclass
class Snapshot:
    """A calendar's objects by href, and what the next poll starts from."""

    source: str
    objects: dict[str, StoredObject] = field(default_factory=dict)
    # CalDAV: the RFC 6578 sync token; None when none is known
    sync_token: str | None = None
    # CalDAV: False once the server refused sync-collection, None when not known yet
    sync_supported: bool | None = None
    # ICS over HTTP: ETag and Last-Modified of the last 200 response
    etag: str | None = None
    last_modified: str | None = None


class SnapshotStore:
    """Where one calendar's snapshot lives; `directory` None keeps it in memory only."""

    def __init__(self, directory: Path | None, *, persist: bool = True) -> None:
        self.directory = directory
        self.persist = persist and directory is not None

    def load(self, source: str) -> Snapshot:
        """The stored snapshot of `source`, or an empty one (logged when unreadable)."""
        if self.directory is None:
            return Snapshot(source)
        file = self.directory / SNAPSHOT_FILE
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
            return self._from_json(raw, source)
        except FileNotFoundError:
            return Snapshot(source)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            log.warning(
                "%s: the calendar snapshot cannot be read (%s); starting afresh", file, error
            )
            return Snapshot(source)

    def _from_json(self, raw: Any, source: str) -> Snapshot:
        if raw.get("format") != FORMAT or raw.get("source") != source:
            log.info("%s: snapshot of another source or format; starting afresh", self.directory)
            return Snapshot(source)
        objects = {
            str(href): StoredObject(
                str(item["data"]).encode("utf-8", "surrogateescape"),
                item.get("etag"),
            )
            for href, item in raw["objects"].items()
        }
        return Snapshot(
            source=source,
            objects=objects,
            sync_token=raw.get("sync_token"),
            sync_supported=raw.get("sync_supported"),
            etag=raw.get("etag"),
            last_modified=raw.get("last_modified"),
        )

    def save(self, snapshot: Snapshot) -> None:
        """Replace the stored snapshot atomically; a failure is logged, not raised."""
        if not self.persist or self.directory is None:
            return
        document = {
            "format": FORMAT,
            "source": snapshot.source,
            "sync_token": snapshot.sync_token,
            "sync_supported": snapshot.sync_supported,
            "etag": snapshot.etag,
            "last_modified": snapshot.last_modified,
            "objects": {
                href: {"etag": item.etag, "data": item.data.decode("utf-8", "surrogateescape")}
                for href, item in snapshot.objects.items()
            },
        }
        self._write(SNAPSHOT_FILE, json.dumps(document).encode("ascii"))

    def load_success(self) -> datetime | None:
        """When the calendar was last read successfully, as recorded; None if never."""
        if self.directory is None:
            return None
        try:
            return datetime.fromisoformat((self.directory / SUCCESS_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def save_success(self, moment: datetime) -> None:
        if self.persist:
            self._write(SUCCESS_FILE, moment.isoformat().encode("ascii"))

    def _write(self, name: str, content: bytes) -> None:
        assert self.directory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            handle, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=self.directory)
            try:
                with os.fdopen(handle, "wb") as stream:
                    stream.write(content)
                    stream.flush()
                    os.fsync(stream.fileno())
                os.replace(temporary, self.directory / name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError as error:
            log.error("%s: cannot write the calendar snapshot: %s", self.directory / name, error)


@dataclass(frozen=True)
class Changes:
    """What one poll changed in the snapshot, by href."""

    added: frozenset[str] = frozenset()
    modified: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()
