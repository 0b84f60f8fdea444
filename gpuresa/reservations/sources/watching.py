"""Noticing a change to a local ICS file or folder at once (Linux inotify), the poll as fallback.

A watch runs on a thread of its own and calls `on_change` (from that
thread) after each burst of changes: a file written, renamed in or out,
removed, or its attributes changed. It watches the file's or folder's parent
too, for the name itself, so a folder replaced by a rename (as configuration
tools install one) or a symbolic link swapped to a new target is watched
again at once. When inotify cannot be had (the per-user watch or instance
limit is reached, the parent folder is missing) the watch says so once in the
log and ends: the daemon's poll reads the calendar as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# A burst of events (an editor's write, rename and chmod) within this many
# milliseconds is one change: one poll rather than three.
SETTLE_MS = 50
# At most one change every this many seconds is told: a user who rewrites a
# file in a loop costs two polls a second, not a busy poll thread.
GAP = 0.5


def open_inotify() -> Any:
    """The inotify gateway: an `inotify_simple.INotify` (raises `OSError` at a limit)."""
    import inotify_simple  # type: ignore[import-untyped]

    return inotify_simple.INotify()


def _masks() -> tuple[int, int]:
    """(what is watched in the path itself, what is watched in its parent for its name)."""
    from inotify_simple import flags

    inside = (
        flags.CLOSE_WRITE
        | flags.MODIFY
        | flags.CREATE
        | flags.DELETE
        | flags.MOVED_TO
        | flags.MOVED_FROM
        | flags.ATTRIB
        | flags.DELETE_SELF
        | flags.MOVE_SELF
    )
    parent = flags.CREATE | flags.DELETE | flags.MOVED_TO | flags.MOVED_FROM | flags.ATTRIB
    return int(inside), int(parent)


class PathWatch:
    """One local path (an ICS file or folder), watched until `close()`.

    `on_change`: called on the watch's thread after each burst of changes.
    `inotify`: makes the inotify gateway (tests give one that fails as a
    kernel at its limit does). `active` says whether inotify watches now.
    """

    def __init__(
        self,
        name: str,
        path: Path,
        on_change: Callable[[], None],
        *,
        inotify: Callable[[], Any] = open_inotify,
    ) -> None:
        self.name = name
        self.path = path
        self.on_change = on_change
        self.active = False
        self._inotify = inotify
        self._closing = threading.Event()
        # a pipe whose write end wakes the thread for `close()`
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(5)

    def close(self) -> None:
        """Stop watching and wait for the thread (idempotent)."""
        if not self._closing.is_set():
            self._closing.set()
            os.write(self._wake_write, b"x")
            self._thread.join(5)
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _run(self) -> None:
        try:
            notify = self._inotify()
        except OSError as error:
            self._fall_back(error)
            return
        try:
            self._watch(notify)
        except OSError as error:
            self._fall_back(error)
        finally:
            self.active = False
            self._ready.set()
            notify.close()

    def _fall_back(self, error: OSError) -> None:
        log.warning(
            "calendar %s: cannot watch %s for changes (%s); it is read at each poll only",
            self.name,
            self.path,
            error.strerror or error,
        )
        self.active = False
        self._ready.set()

    def _watch(self, notify: Any) -> None:
        inside_mask, parent_mask = _masks()
        parent = notify.add_watch(str(self.path.parent), parent_mask)
        inside = self._add_inside(notify, inside_mask)
        self.active = True
        self._ready.set()
        while not self._closing.is_set():
            readable, _, _ = select.select([notify.fileno(), self._wake_read], [], [])
            if self._closing.is_set():
                return
            if notify.fileno() not in readable:
                continue
            events = notify.read(timeout=0, read_delay=SETTLE_MS)
            # in the parent, only the path's own name is the calendar's business; a watch
            # given up tells nothing more (its last word, IN_IGNORED, comes after the rewatch)
            events = [
                event
                for event in events
                if (event.wd == parent and event.name == self.path.name)
                or (inside is not None and event.wd == inside)
            ]
            if not events:
                continue
            if any(event.wd == parent for event in events) or inside is None:
                # the path itself came, went or was replaced: watch what is there now
                inside = self._rewatch(notify, inside, inside_mask)
            self.on_change()
            self._closing.wait(GAP)

    def _add_inside(self, notify: Any, mask: int) -> int | None:
        """Watch the path itself; None while it does not exist (its parent tells when it does)."""
        try:
            return int(notify.add_watch(str(self.path), mask))
        except FileNotFoundError:
            return None

    def _rewatch(self, notify: Any, inside: int | None, mask: int) -> int | None:
        if inside is not None:
            # (an error: the watch went with the folder it watched)
            with contextlib.suppress(OSError):
                notify.rm_watch(inside)
        return self._add_inside(notify, mask)


class Watches:
    """A `PathWatch` for each source with a local path; `close()` ends them all."""

    def __init__(
        self,
        sources: Iterable[object],
        on_change: Callable[[], None],
        *,
        inotify: Callable[[], Any] = open_inotify,
    ) -> None:
        self.watches: list[PathWatch] = []
        for source in sources:
            where = getattr(source, "watch_path", None)
            path = where() if callable(where) else None
            if isinstance(path, Path):
                name = str(getattr(source, "name", path))
                self.watches.append(PathWatch(name, path, on_change, inotify=inotify))

    def close(self) -> None:
        for watch in self.watches:
            watch.close()
