"""Homes unused for `[storage] home_retention` are removed, their users told before.

A home's last use is its image's modification time (set when a session
attaches it and when the last one lets it go, see `homes.store`). Each
maintenance round, for each home no session has: once its removal is
`home_removal_notice` away, its user is told by e-mail (once per last use: a
notice names the last use it was sent for, in `<login>.notice` beside the
image, so a home used again and left again is noticed again); once the
removal is due and the notice has had its time, the image goes. A session
booked meanwhile finds the home as it was: nothing is removed while a view of
it exists, and the check and the removal are made under the homes' lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuresa.access import AccessError, check_login
from gpuresa.config.sections import Config
from gpuresa.homes import paths, store
from gpuresa.mail.notices import SUBJECT_PREFIX
from gpuresa.mail.wording import format_remaining, format_time

log = logging.getLogger(__name__)

# (key, kind, login, booking's e-mail, (subject, body)) -> queued
ToUser = Callable[[str, str, str, "str | None", tuple[str, str]], bool]


def removal_of(last_use: datetime, noticed: datetime | None, config: Config) -> datetime | None:
    """When a home last used at `last_use` goes: its retention after, and never before its
    notice (sent at `noticed`) has had its time. None: homes are kept forever."""
    storage = config.storage
    if storage.home_retention == "forever":
        return None
    planned = last_use + storage.home_retention
    if noticed is not None:
        return max(planned, noticed + storage.home_removal_notice)
    return planned


def removal_message(
    config: Config, login: str, last_use: datetime, removal: datetime
) -> tuple[str, str]:
    """What the user is told before their home goes."""
    timezone = config.reservations.timezone
    host = config.daemon.host
    subject = f"{SUBJECT_PREFIX} Your home on {host} will be removed"
    body = f"""Hello {login},

your home on {host} (/home/{login} in your sessions) has not been used since
{format_time(last_use, timezone)}. It will be removed with everything in it on
{format_time(removal, timezone)} ({format_remaining(removal - last_use)} after its last use).

Book a session before then to keep it: each session you have there resets the
time. To keep only some of it, book a session and copy what you need to
/output, which you can download after the session's end.
"""
    return subject, body


def _notice_path(image: Path) -> Path:
    return image.with_suffix(".notice")


def last_use_of(image: Path) -> tuple[int, datetime]:
    """`image`'s last use: its modification time in nanoseconds (what is compared, whole)
    and as a time."""
    nanoseconds = image.stat().st_mtime_ns
    return nanoseconds, datetime.fromtimestamp(nanoseconds / 1e9, UTC)


def noticed(image: Path, last_use_ns: int) -> datetime | None:
    """When the notice for this last use (in nanoseconds) went out, or None."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        record = json.loads(_notice_path(image).read_text())
        if int(record["for_ns"]) == last_use_ns:
            return datetime.fromtimestamp(float(record["sent"]), UTC)
    return None


def _remember_notice(image: Path, last_use_ns: int, now: datetime) -> None:
    text = json.dumps({"for_ns": last_use_ns, "sent": now.timestamp()})
    path = _notice_path(image)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)


def review(config: Config, now: datetime, to_user: ToUser) -> str:
    """One round: notices due, removals due; a line for the log. Raises `OSError`."""
    if not paths.enabled(config) or config.storage.home_retention == "forever":
        return "homes kept"
    root = paths.images_folder(config)
    if not root.is_dir():
        return "no home yet"
    told = removed = 0
    in_use = {login for login, _, _ in store.views(config)}
    for image in sorted(root.glob("*.img")):
        login = image.stem
        try:
            check_login(login)
        except AccessError:
            continue  # not one of gpuresa's names
        if login in in_use:
            continue
        last_ns, last_use = last_use_of(image)
        sent = noticed(image, last_ns)
        removal = removal_of(last_use, sent, config)
        assert removal is not None
        notice = config.storage.home_removal_notice
        if sent is None and notice > timedelta(0):
            if now >= removal - notice:
                # sent late, the removal moves to now + the notice
                message = removal_message(config, login, last_use, max(removal, now + notice))
                to_user(f"home-{login}", f"home-removal-{last_use:%Y%m%dT%H%M%S}", login, None,
                        message)  # fmt: skip
                _remember_notice(image, last_ns, now)
                told += 1
            continue
        if now >= removal and _remove(config, login, image, last_ns):
            removed += 1
    return f"{told} home removal notice(s), {removed} home(s) removed"


def _remove(config: Config, login: str, image: Path, last_use_ns: int) -> bool:
    """Remove `login`'s home unless a session took it meanwhile (checked under the lock)."""
    with store.locked(config):
        if any(name == login for name, _, _ in store.views(config)):
            return False
        if image.stat().st_mtime_ns != last_use_ns:
            return False  # used since
        image.unlink()
        _notice_path(image).unlink(missing_ok=True)
    log.info("%s's home %s removed: unused since %d ns", login, image, last_use_ns)
    return True
