"""Logging set-up that reads well on a terminal and in journald."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Mapping
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


# how each line of a record after its first begins: no line of a message can pass for a
# record of its own (a timestamp, a level, a logger's name at the start of a line)
CONTINUATION = "  | "


class _Shown:
    """A log argument that is not a string (an error, a path, a record of gpuresa's) as a
    message shows it: its own line breaks kept, every other hidden character escaped."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return "\n".join(inert(line) for line in str(self.value).split("\n"))

    def __repr__(self) -> str:
        return inert(repr(self.value))


def _shown(value: object) -> object:
    if isinstance(value, str):
        return inert(value)  # a value quoted from a calendar: one line, whatever it holds
    if isinstance(value, (int, float)):
        return value  # for %d and %.1f
    return _Shown(value)


def message_lines(record: logging.LogRecord) -> list[str]:
    """The lines of `record`'s message, each inert.

    Line breaks come only from gpuresa's own text: the format string, and the
    arguments that are not strings (errors it raises, with a container's last
    lines, or a config's problems, one a line). A string argument is a value,
    perhaps a calendar's: its line breaks are escaped, so it stays on its line.
    """
    arguments = record.args
    try:
        if isinstance(arguments, Mapping):
            text = str(record.msg) % {key: _shown(value) for key, value in arguments.items()}
        elif arguments:
            text = str(record.msg) % tuple(_shown(value) for value in arguments)
        else:
            text = str(_Shown(record.msg)) if not isinstance(record.msg, str) else record.msg
    except (TypeError, ValueError, KeyError):
        # a format string and arguments that do not match: logging's own text, one line
        return [inert(record.getMessage())]
    return [inert(line) for line in text.split("\n")]


class InertFormatter(logging.Formatter):
    """A formatter whose records cannot carry control characters or forge lines.

    Messages quote calendar text (file names, hrefs, UIDs, titles): every line
    is made inert (`gpuresa.inert.inert`), so a carriage return, escape
    sequence or bidi control in it is written as an escape, and a value's line
    break too (`message_lines`). A message that gpuresa writes on several
    lines keeps them, each after the first marked with `CONTINUATION`. A
    traceback keeps its lines, each made inert the same way.
    """

    def format(self, record: logging.LogRecord) -> str:
        first, *rest = message_lines(record)
        record.message = first
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lines = [self.formatMessage(record), *(CONTINUATION + line for line in rest)]
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
