"""ICS calendars: a local `.ics` file, a folder of `.ics` files, or an http(s) feed.

- A file or folder is read again only when a file's size or modification time
  changed (or files came or went); objects are keyed by file name.
- A feed (LibreBooking's, an export URL of any calendar app) is fetched with
  a conditional GET (If-None-Match / If-Modified-Since): an unchanged feed
  costs one request and an empty 304 answer.
- A file or folder is also watched (`watching`): a change is read within a
  fraction of a second rather than at the next poll.

Like every source, the last good copy is kept on disk, and a failure raises
`SourceError` with a one-line reason (a feed URL's query and the end of its
path, which often hold an access key, are never shown). Content that is not a
complete iCalendar stream (an HTML login page, an empty or half-written file)
is such a failure, not an empty calendar: the snapshot stays. In a folder,
one file that cannot be read (half-written, unreadable, too large) fails
alone: it is named in the poll's `problems`, its last good copy stays (a file
being rewritten cancels nothing), and it is read again at the next poll.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.loading import read_secret
from gpuresa.errors import UserError
from gpuresa.reservations.sources import (
    PollResult,
    SourceError,
    icalendar_problem,
    one_line,
    shown_url,
    url_secrets,
)
from gpuresa.reservations.sources.snapshot import Snapshot, SnapshotStore, StoredObject

log = logging.getLogger(__name__)

MAX_BYTES = 64 * 1024 * 1024
FEED_NAME = "feed.ics"


class ICSSource:
    """An ICS file, folder or feed; see the module's docstring."""

    def __init__(
        self,
        calendar: CalendarConfig,
        state_dir: Path | None,
        *,
        persist: bool = True,
        timeout: float = 30.0,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.name = calendar.name
        self.calendar = calendar
        self.location = calendar.url
        self.is_feed = calendar.url.startswith(("http://", "https://"))
        directory = state_dir / "calendars" / calendar.name if state_dir is not None else None
        self.store = SnapshotStore(directory, persist=persist)
        self.state: Snapshot = self.store.load(self.location)
        self.last_success: datetime | None = (
            self.store.load_success() if self.state.objects else None
        )
        self.timeout = timeout
        self.max_bytes = max_bytes
        # file name -> (modification time, size) of what the snapshot holds
        self._seen: dict[str, tuple[int, int]] = {}
        self._session: Any = None
        # the files of a folder that could not be read at the last poll: why
        self.problems: dict[str, str] = {}

    def watch_path(self) -> Path | None:
        """The local file or folder to watch for changes (`watching`); None for a feed."""
        return None if self.is_feed else Path(self.location)

    def snapshot(self) -> Mapping[str, bytes]:
        """The objects of the last successful poll, or of the snapshot loaded from disk."""
        return {name: stored.data for name, stored in self.state.objects.items()}

    def poll(self, now: datetime | None = None) -> PollResult:
        """Read the file, folder or feed if it changed; raises `SourceError` on failure.

        `now` is recorded as the time of this success (default: the clock).
        """
        if self.is_feed:
            changed, requests, received = self._poll_feed()
        else:
            changed, requests, received = self._poll_files()
        if changed:
            self.store.save(self.state)
        now = now or datetime.now(UTC)
        self.last_success = now
        self.store.save_success(now)
        return PollResult(self.snapshot(), changed, requests, received, dict(self.problems))

    # --- files ---------------------------------------------------------------------------

    def _poll_files(self) -> tuple[bool, int, int]:
        path = Path(self.location)
        try:
            if path.is_dir():
                files = {
                    entry.name: entry
                    for entry in sorted(path.iterdir())
                    if entry.suffix.lower() == ".ics"
                    and not entry.name.startswith(".")
                    and entry.is_file()
                }
            elif path.is_file():
                files = {path.name: path}
            else:
                raise SourceError(f"calendar {self.name}: {path}: no such file or folder")
            signatures = {}
            for name, file in files.items():
                status = file.stat()
                signatures[name] = (status.st_mtime_ns, status.st_size)
        except OSError as error:
            raise SourceError(
                f"calendar {self.name}: cannot read {path}: {error.strerror or error}"
            ) from None
        objects = dict(self.state.objects)
        # committed only with the objects: a failed poll must not mark a file as read
        seen = dict(self._seen)
        received = 0
        changed = False
        for name in [name for name in objects if name not in files]:
            # a file that went away takes its bookings with it
            del objects[name]
            seen.pop(name, None)
            changed = True
        problems: dict[str, str] = {}
        for name, file in files.items():
            if seen.get(name) == signatures[name] and name in objects:
                continue
            problem = self._file_problem(file, signatures[name][1])
            if isinstance(problem, str):
                if not path.is_dir():
                    raise SourceError(f"calendar {self.name}: {problem}")
                # one file of a folder (most often one being rewritten) fails alone: its
                # last good copy stays, and it is read again at the next poll
                problems[name] = problem
                continue
            data = problem
            received += len(data)
            seen[name] = signatures[name]
            if name not in objects or objects[name].data != data:
                objects[name] = StoredObject(data)
                changed = True
        self.state.objects = objects
        self._seen = seen
        self.problems = problems
        return changed, 0, received

    def _file_problem(self, file: Path, size: int) -> bytes | str:
        """The content of `file`, or why it cannot be a calendar object (with its path)."""
        if size > self.max_bytes:
            return f"{file} is larger than {self.max_bytes} bytes"
        try:
            data = file.read_bytes()
        except OSError as error:
            return f"cannot read {file}: {error.strerror or error}"
        problem = icalendar_problem(data)
        return data if problem is None else f"{file}: {problem}"

    # --- feeds ---------------------------------------------------------------------------

    def _poll_feed(self) -> tuple[bool, int, int]:
        import requests

        session = self._connect()
        headers = {"Accept": "text/calendar, */*;q=0.5"}
        if self.state.objects and self.state.etag:
            headers["If-None-Match"] = self.state.etag
        if self.state.objects and self.state.last_modified:
            headers["If-Modified-Since"] = self.state.last_modified
        where = shown_url(self.location)
        try:
            with session.get(
                self.location,
                headers=headers,
                timeout=self.timeout,
                verify=self.calendar.verify_tls,
                stream=True,
            ) as response:
                received = sum(
                    len(name) + len(value) + 4 for name, value in response.headers.items()
                )
                if response.status_code == 304:
                    return False, 1, received + 17
                if response.status_code != 200:
                    raise SourceError(
                        f"calendar {self.name}: {where} answered HTTP {response.status_code} "
                        f"{response.reason or ''}".rstrip()
                    )
                chunks: list[bytes] = []
                size = 0
                for chunk in response.iter_content(65536):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise SourceError(
                            f"calendar {self.name}: {where} sent more than {self.max_bytes} bytes"
                        )
                    chunks.append(chunk)
                etag = response.headers.get("ETag")
                last_modified = response.headers.get("Last-Modified")
        except SourceError:
            raise
        except requests.RequestException as error:
            secrets = url_secrets(self.location)
            raise SourceError(
                f"calendar {self.name}: cannot fetch {where}: {one_line(error, secrets)}"
            ) from None
        data = b"".join(chunks)
        problem = icalendar_problem(data)
        if problem is not None:
            # a login page or a cut-off answer is no reason to drop every booking
            raise SourceError(f"calendar {self.name}: what {where} sent: {problem}")
        name = PurePosixPath(urlsplit(self.location).path).name or FEED_NAME
        if not name.lower().endswith(".ics"):
            name = FEED_NAME
        previous = self.state.objects.get(name)
        changed = previous is None or previous.data != data or len(self.state.objects) != 1
        self.state.objects = {name: StoredObject(data, etag)}
        self.state.etag = etag
        self.state.last_modified = last_modified
        return changed, 1, received + size + 17

    def _connect(self) -> Any:
        if self._session is None:
            import requests
            from requests.auth import HTTPBasicAuth, HTTPDigestAuth

            session = requests.Session()
            session.headers["User-Agent"] = "gpuresa (calendar poller)"
            if self.calendar.username is not None:
                try:
                    password = read_secret(
                        f"calendars[{self.name}]",
                        self.calendar.password_file,
                        self.calendar.password_credential,
                    )
                except UserError as error:
                    raise SourceError(f"calendar {self.name}: {error}") from None
                assert password is not None
                if self.calendar.auth == "digest":
                    session.auth = HTTPDigestAuth(self.calendar.username, password)
                else:
                    session.auth = HTTPBasicAuth(self.calendar.username, password)
            self._session = session
        return self._session
