"""Logging set-up that reads well on a terminal and in journald."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any, ClassVar

from gpuresa.inert import inert

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
            InertFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # the libraries' debug output drowns ours; raise them only with -vv
    for noisy in ("urllib3", "docker", "caldav", "paramiko", "radicale"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)


class InertFormatter(logging.Formatter):
    """A formatter whose records cannot carry control characters or forge lines.

    Messages quote calendar text (file names, hrefs, UIDs, titles): the whole
    message is made inert (`gpuresa.inert.inert`), so a line break, carriage
    return, escape sequence or bidi control in it is written as an escape. A
    traceback keeps its lines, each made inert the same way.
    """

    def format(self, record: logging.LogRecord) -> str:
        record.message = inert(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lines = [self.formatMessage(record)]
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for block in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if block:
                lines.extend(inert(line) for line in block.splitlines())
        return self.join(lines, record)

    def formatException(self, ei: Any) -> str:
        """The traceback, with each exception's message (which may quote calendar
        text, line breaks included) made one inert line; frame lines are code."""
        chunks: list[str] = []
        for chunk in traceback.TracebackException(*ei[:3]).format():
            code = chunk.startswith(("  ", "Traceback", "\n"))
            chunks.append(chunk if code else inert(chunk.rstrip("\n")) + "\n")
        return "".join(chunks).rstrip("\n")

    def join(self, lines: list[str], record: logging.LogRecord) -> str:
        """The record's text from its (inert) lines."""
        return "\n".join(lines)


class JournalFormatter(InertFormatter):
    """Prefix each line with the syslog priority journald understands (`<3>` = error).

    Every line of a record (a traceback's too) carries the prefix, so no line
    takes the priority journald gives unprefixed text, and since calendar
    text is inert no line can start with a `<N>` of its own choosing.
    """

    PRIORITIES: ClassVar[dict[int, int]] = {
        logging.CRITICAL: 2,
        logging.ERROR: 3,
        logging.WARNING: 4,
        logging.INFO: 6,
        logging.DEBUG: 7,
    }

    def join(self, lines: list[str], record: logging.LogRecord) -> str:
        priority = self.PRIORITIES.get(record.levelno, 6)
        return "\n".join(f"<{priority}>{line}" for line in lines)


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
