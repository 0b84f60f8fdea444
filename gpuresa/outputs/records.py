"""Finished outputs: when each ended, when it is removed, and whether its user was told.

One small JSON file per output folder in `<state_dir>/outputs/`, written
atomically, so that a daemon restart keeps the dates and the journal (being
reworked elsewhere) stays out of it. Everything about dates is pure:
`planned_removal`, `notice_due` and `removal_due` take `now`.

Rules (retention R, notice N, both from [storage]):
- an output ended at E is planned for removal at E + max(R, N);
- its notice is due N before that, and is sent once;
- it is removed at the later of the planned date and notice + N: a user is
  always told at least N ahead, even when mail was late; never while a
  session uses the folder; never with retention "forever".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.access import LOGIN_PATTERN, RESERVED_LOGINS
from gpuresa.config.sections import StorageConfig
from gpuresa.outputs.tree import walk
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputFolder:
    """One session's output folder, finished or in use."""

    user: str
    relative: str
    path: Path
    ended: datetime | None
    key: str = ""
    notice_sent: datetime | None = None
    busy: bool = False
    # an output that could not be copied out of its capped image: `path` is the image
    image: Path | None = None

    def removal(self, storage: StorageConfig) -> datetime | None:
        """When it will be removed (None: kept forever, or in use)."""
        if self.busy or self.ended is None:
            return None
        planned = planned_removal(self.ended, storage)
        if planned is None:
            return None
        if self.notice_sent is not None:
            return max(planned, self.notice_sent + storage.output_removal_notice)
        return planned


def planned_removal(ended: datetime, storage: StorageConfig) -> datetime | None:
    """E + max(R, N), or None with retention "forever"."""
    if storage.output_retention == "forever":
        return None
    return ended + max(storage.output_retention, storage.output_removal_notice)


def notice_due(folder: OutputFolder, now: datetime, storage: StorageConfig) -> bool:
    """Whether the removal notice of `folder` should go out now."""
    if folder.busy or folder.ended is None or folder.notice_sent is not None:
        return False
    planned = planned_removal(folder.ended, storage)
    return planned is not None and now >= planned - storage.output_removal_notice


def removal_due(folder: OutputFolder, now: datetime, storage: StorageConfig) -> bool:
    """Whether `folder` should be removed now (its notice went out at least N ago)."""
    if folder.busy or folder.ended is None:
        return False
    if folder.notice_sent is None and storage.output_removal_notice > timedelta(0):
        return False
    removal = folder.removal(storage)
    return removal is not None and now >= removal


class OutputRecords:
    """The JSON records of one host's output folders, in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _file(self, relative: str) -> Path:
        digest = hashlib.sha256(relative.encode("utf-8")).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def read(self, relative: str) -> dict[str, str] | None:
        try:
            data = json.loads(self._file(relative).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("output record of %s is unreadable (%s); starting afresh", relative, error)
            return None
        if not isinstance(data, dict) or data.get("relative") != relative:
            return None
        return {str(name): str(value) for name, value in data.items() if value is not None}

    def write(self, relative: str, values: dict[str, str]) -> None:
        """Replace the record of `relative` (atomically: a crash leaves the old or the new)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        text = json.dumps({**values, "relative": relative}, sort_keys=True)
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.replace(temporary, self._file(relative))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def record_end(self, relative: str, user: str, key: str, ended: datetime) -> None:
        """A session using `relative` ended at `ended`: its retention starts afresh."""
        self.write(relative, {"user": user, "key": key, "ended": ended.isoformat()})

    def record_notice(self, relative: str, sent: datetime) -> None:
        values = self.read(relative) or {}
        self.write(relative, {**values, "notice_sent": sent.isoformat()})

    def record_image(self, key: str, user: str, image: Path, ended: datetime) -> None:
        """Session `key`'s output stays in `image`: its retention starts at `ended`, once."""
        relative = image_relative(key)
        if (self.read(relative) or {}).get("image"):
            return
        values = {"user": user, "key": key, "ended": ended.isoformat(), "image": str(image)}
        self.write(relative, values)

    def images(self) -> list[OutputFolder]:
        """The outputs kept in their images (`record_image`) whose image is still there."""
        found = []
        for file in sorted(self.directory.glob("*.json")):
            try:
                values = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(values, dict) or not values.get("image"):
                continue
            image, relative = Path(str(values["image"])), str(values.get("relative", ""))
            if not image.is_file():
                # copied out later (or removed): the output is an ordinary folder now
                self.forget(relative)
                continue
            found.append(
                replace(
                    self.folder(str(values.get("user", "")), relative, image, False), image=image
                )
            )
        return found

    def forget(self, relative: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._file(relative).unlink()

    def folder(self, user: str, relative: str, path: Path, busy: bool) -> OutputFolder:
        values = self.read(relative) or {}
        return OutputFolder(
            user=user,
            relative=relative,
            path=path,
            ended=_instant(values.get("ended")),
            key=values.get("key", ""),
            notice_sent=_instant(values.get("notice_sent")),
            busy=busy,
        )


# the records of outputs kept in their images: never a login's folder (logins never
# start with a dot), one per session
IMAGES_RELATIVE = ".images"


def image_relative(key: str) -> str:
    """The record name of session `key`'s output kept in its image."""
    return f"{IMAGES_RELATIVE}/{safe_key(key)}"


def _instant(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def folders_below(folder: Path, depth: int) -> Iterator[Path]:
    """Real folders exactly `depth` levels below `folder`; links are never entered."""
    if depth == 0:
        yield folder
        return
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from folders_below(Path(entry.path), depth - 1)


def pattern_depth(storage: StorageConfig) -> int:
    """How many folders below the login folder each output sits (1 with the default)."""
    return max(len(Path(storage.output_pattern).parts) - 1, 0)


def login_names(output_root: Path) -> list[str]:
    """The logins that have a real folder in the output root."""
    try:
        entries = sorted(os.scandir(output_root), key=lambda entry: entry.name)
    except FileNotFoundError:
        return []
    return [
        entry.name
        for entry in entries
        if entry.is_dir(follow_symlinks=False)
        and LOGIN_PATTERN.fullmatch(entry.name)
        and entry.name not in RESERVED_LOGINS
    ]


def scan(
    storage: StorageConfig,
    records: OutputRecords,
    busy: Collection[Path],
    now: datetime | None = None,
) -> list[OutputFolder]:
    """Every output folder under the output root, with its record.

    `busy` holds the folders sessions use now; a folder with no record that
    changed within `SETTLE` counts as busy too (it may belong to a session
    being made). With `now`, a finished folder that has no record (made before
    records were kept, or its stop was never finished) is recorded as ended at
    `now`, so it gets its full retention. Outputs that could not be copied out
    of their images are listed too, their image as their path.
    """
    busy_set = {Path(path) for path in busy}
    depth = pattern_depth(storage)
    found = []
    for user in login_names(storage.output_root):
        for path in folders_below(storage.output_root / user, depth):
            if path == storage.output_root / user:
                continue
            relative = path.relative_to(storage.output_root).as_posix()
            folder = records.folder(user, relative, path, path in busy_set)
            if folder.ended is None and not folder.busy and recently_changed(path):
                # no record, changed lately: a session being made (its containers not
                # there yet) as likely as a stop never finished; left alone for now
                folder = replace(folder, busy=True)
            if folder.ended is None and not folder.busy and now is not None:
                log.info("output %s has no end recorded; its retention starts now", path)
                records.record_end(relative, user, folder.key, now)
                folder = replace(folder, ended=now)
            found.append(folder)
    found.extend(records.images())
    return found


# How long a folder with no record must have been left unchanged before it counts
# as finished (a session's folder exists a few seconds before its containers do).
SETTLE = timedelta(hours=1)


def recently_changed(path: Path) -> bool:
    """Whether `path` changed (its modification time) within `SETTLE`."""
    try:
        changed = path.lstat().st_mtime
    except OSError:
        return False
    return time.time() - changed < SETTLE.total_seconds()


def folder_bytes(path: Path) -> int:
    """Bytes used below `path`, never following a link, at any depth (0 when unreadable)."""
    total = 0

    def count(_folder: int, _name: str, details: os.stat_result) -> None:
        nonlocal total
        if stat.S_ISREG(details.st_mode):
            total += details.st_blocks * 512

    with contextlib.suppress(OSError):
        walk(path, count)
    return total
