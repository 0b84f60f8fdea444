"""A session's containers as Docker shows them: found by label, grouped by role."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuresa.model import IdRange, Session
from gpuresa.sessions.labels import FTP_ROLE, KEY_LABEL, MAIN_ROLE, ROLE_LABEL, session_from_labels

log = logging.getLogger(__name__)


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


def by_key(containers: Iterable[dict[str, Any]]) -> dict[str, Found]:
    """Containers of several sessions, grouped by session key, then by role."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for container in containers:
        key = container.get("Config", {}).get("Labels", {}).get(KEY_LABEL)
        if key is not None:
            grouped.setdefault(key, []).append(container)
    return {key: by_role(members) for key, members in grouped.items()}


def container_roles(containers: Iterable[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Each gpuresa container's full id with its session key and role ("main", "ftp")."""
    roles = {}
    for container in containers:
        labels = container.get("Config", {}).get("Labels", {})
        key, role = labels.get(KEY_LABEL), labels.get(ROLE_LABEL)
        if key is not None and role is not None:
            roles[str(container["Id"])] = (key, role)
    return roles


def session_from(
    key: str,
    found: Found,
    end: datetime | None,
    *,
    gated: bool = False,
    id_range: IdRange | None = None,
) -> Session | None:
    """The session that containers `found` make up; None when there are none.

    state: "running" (both containers run and logins are let in), "created"
    (prepared: the main container not started yet, or running behind the
    login gate, `gated`) or "stopped" (anything else: exited, half there).
    `end`, when given, overrides the labels' (a moved end); `id_range` is the
    session's host ids, which the engine tells (see `engines`). Containers whose
    labels gpuresa did not write are logged and give None.
    """
    reference = found.main or found.ftp
    if reference is None:
        return None
    main, sidecar = status(found.main), status(found.ftp)
    if main == sidecar == "running":
        state = "created" if gated else "running"
    elif main == "created" and sidecar in ("created", "running"):
        # prepared: the sidecar may already run, the user's container not yet
        state = "created"
    else:
        # exited, killed, or half there
        state = "stopped"
    password = environment(found.ftp).get("FTP_PASSWORD", "") if found.ftp else ""
    names = tuple(container_name(container) for container in found.all)
    try:
        return session_from_labels(
            reference["Config"]["Labels"], state, names, password, end, id_range
        )
    except (KeyError, ValueError) as error:
        log.warning("%s: containers %s have labels gpuresa cannot read (%s)", key, names, error)
        return None


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
