"""What `gpuresa homes list` shows: each login's home, its use, and when it goes."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime

from gpuresa.access import AccessError, check_login
from gpuresa.config.sections import Config
from gpuresa.homes import paths, retention, store


@dataclass(frozen=True)
class Home:
    """One login's home on this host."""

    login: str
    used: int  # bytes it takes on the disk
    cap: int  # its image's size: the most it can hold
    last_use: datetime
    sessions: int  # sessions that have it now
    removal: datetime | None  # None: kept (forever, or in use)
    noticed: datetime | None  # when its user was told of the removal

    def as_json(self) -> dict[str, object]:
        return {
            "login": self.login,
            "used_bytes": self.used,
            "cap_bytes": self.cap,
            "last_use": self.last_use.isoformat(),
            "sessions": self.sessions,
            "removal": self.removal.isoformat() if self.removal else None,
            "noticed": self.noticed.isoformat() if self.noticed else None,
        }


def homes(config: Config) -> list[Home]:
    """Every home in `home_root`, by login."""
    root = paths.images_folder(config)
    found: list[Home] = []
    in_use: dict[str, int] = {}
    for login, _, _ in store.views(config):
        in_use[login] = in_use.get(login, 0) + 1
    with contextlib.suppress(OSError):
        for image in sorted(root.glob("*.img")):
            try:
                check_login(image.stem)
                details = image.stat()
            except (AccessError, OSError):
                continue
            last_ns, last_use = retention.last_use_of(image)
            noticed = retention.noticed(image, last_ns)
            sessions = in_use.get(image.stem, 0)
            removal = None if sessions else retention.removal_of(last_use, noticed, config)
            used = details.st_blocks * 512
            home = Home(image.stem, used, details.st_size, last_use, sessions, removal, noticed)
            found.append(home)
    return found
