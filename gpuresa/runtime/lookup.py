"""A session's containers as Docker shows them: found by label, grouped by role."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuresa.runtime.payload import FTP_ROLE, MAIN_ROLE, ROLE_LABEL


@dataclass(frozen=True)
class Found:
    """A session's containers (full `inspect` output), by role; None where missing."""

    main: dict[str, Any] | None
    ftp: dict[str, Any] | None

    @property
    def all(self) -> list[dict[str, Any]]:
        return [container for container in (self.main, self.ftp) if container is not None]

    @property
    def complete(self) -> bool:
        return self.main is not None and self.ftp is not None


def by_role(containers: Iterable[dict[str, Any]]) -> Found:
    """Sort one session's containers by their role label."""
    main = ftp = None
    for container in containers:
        role = container.get("Config", {}).get("Labels", {}).get(ROLE_LABEL)
        if role == MAIN_ROLE:
            main = container
        elif role == FTP_ROLE:
            ftp = container
    return Found(main, ftp)


def status(container: dict[str, Any] | None) -> str:
    """Docker's status of a container ("running", "created", "exited"…), or "missing"."""
    if container is None:
        return "missing"
    return str(container.get("State", {}).get("Status", "unknown"))


def container_name(container: dict[str, Any]) -> str:
    """A container's name (readable in logs and errors), else its id."""
    return str(container.get("Name") or container["Id"]).lstrip("/")


def environment(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment variables."""
    pairs = (item.partition("=") for item in container.get("Config", {}).get("Env") or [])
    return {name: value for name, _, value in pairs}


def init_pid(container: dict[str, Any]) -> int:
    """The host pid of a running container's init (0 when it does not run)."""
    return int(container.get("State", {}).get("Pid") or 0)
