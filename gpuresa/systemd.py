"""The sd_notify protocol without dependencies: READY, STATUS, WATCHDOG, STOPPING.

Under systemd with `Type=notify`, $NOTIFY_SOCKET names a datagram socket (a
path, or an abstract name written with a leading "@"); each message is a few
`NAME=value` lines. Outside systemd every function here does nothing and
returns False, so the daemon calls them unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(message: str) -> bool:
    """Send `message` ("READY=1", "STATUS=…", several lines) to systemd.

    Returns True when it was sent, False when not running under systemd
    ($NOTIFY_SOCKET unset or of an unsupported kind) or when sending failed
    (the failure is logged, never raised: the service must not die of it).
    """
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        # an abstract socket: the name starts with a NUL byte instead of "@"
        target = "\0" + address[1:]
    elif address.startswith("/"):
        target = address
    else:
        # unset, empty, or a kind this module does not speak (vsock:…)
        if address:
            log.debug("NOTIFY_SOCKET=%r is not a path or an abstract name; not notifying", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # never wait on a notify socket nobody reads: a full queue drops the message
            sock.settimeout(0.5)
            sock.connect(target)
            sock.sendall(message.encode("utf-8"))
    except OSError as error:
        log.warning("cannot notify systemd through %s: %s", address, error.strerror or error)
        return False
    return True


def _status_line(text: str) -> str:
    # one line: a line break in the text would start another NAME=value
    return "STATUS=" + " ".join(text.split())


def ready(status: str | None = None) -> bool:
    """Tell systemd the service is up (READY=1), with a status line if given."""
    return notify("READY=1" + (f"\n{_status_line(status)}" if status else ""))


def status(text: str) -> bool:
    """Set the one-line status that `systemctl status` shows."""
    return notify(_status_line(text))


def watchdog() -> bool:
    """Tell systemd the service is alive (WATCHDOG=1); call it every `watchdog_interval() / 2`."""
    return notify("WATCHDOG=1")


def reloading(status: str | None = None) -> bool:
    """Tell systemd the configuration is being reloaded; send `ready()` when done."""
    return notify("RELOADING=1" + (f"\n{_status_line(status)}" if status else ""))


def stopping(status: str | None = None) -> bool:
    """Tell systemd the service is shutting down (STOPPING=1)."""
    return notify("STOPPING=1" + (f"\n{_status_line(status)}" if status else ""))


def watchdog_interval() -> float | None:
    """The watchdog time-out in seconds ($WATCHDOG_USEC), or None when there is none.

    None also when $WATCHDOG_PID names another process (the variables were
    inherited, they are not for us) or when a value is not a positive number.
    Send `watchdog()` at least twice per interval.
    """
    microseconds = os.environ.get("WATCHDOG_USEC")
    if not microseconds:
        return None
    owner = os.environ.get("WATCHDOG_PID")
    if owner:
        try:
            if int(owner) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(microseconds)
    except ValueError:
        return None
    if value <= 0:
        return None
    return value / 1_000_000
