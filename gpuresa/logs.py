"""Logging set-up that reads well on a terminal and in journald."""

from __future__ import annotations

import logging
import os
import sys
from typing import ClassVar

LEVELS = [logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG]


def setup_logging(verbosity: int = 0) -> None:
    """Configure the root logger; `verbosity` 0 is INFO, -1 WARNING, 1 DEBUG.

    Under systemd (JOURNAL_STREAM is set) records carry no timestamp of our
    own, since journald adds its own, and a `<N>` priority prefix that journald
    reads as the record's level.
    """
    level = LEVELS[max(0, min(len(LEVELS) - 1, 2 + verbosity))]
    handler = CurrentStderrHandler()
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # the libraries' debug output drowns ours; raise them only with -vv
    for noisy in ("urllib3", "docker", "caldav", "paramiko", "radicale"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)


class JournalFormatter(logging.Formatter):
    """Prefix each line with the syslog priority journald understands (`<3>` = error)."""

    PRIORITIES: ClassVar[dict[int, int]] = {
        logging.CRITICAL: 2,
        logging.ERROR: 3,
        logging.WARNING: 4,
        logging.INFO: 6,
        logging.DEBUG: 7,
    }

    def format(self, record: logging.LogRecord) -> str:
        priority = self.PRIORITIES.get(record.levelno, 6)
        return f"<{priority}>{super().format(record)}"


class CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a record is emitted.

    A handler bound to the stream of the moment breaks when that stream is
    replaced and closed (a test capturing output, a daemonising wrapper).
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        # the stream is always the current sys.stderr
        pass
