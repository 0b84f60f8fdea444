"""User namespaces: sessions run only on an engine where a container's root is not the host's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuresa.sessions.errors import SessionError

# SecurityOptions names under which root in a container is not root on the host
USER_NAMESPACE_OPTIONS = frozenset({"userns", "rootless"})


def require_user_namespaces(info: Mapping[str, Any]) -> None:
    """Check that the engine whose `docker info` is `info` runs containers in user namespaces.

    Given the engine's info; returns when its SecurityOptions name `userns`
    (userns-remap) or `rootless`. Raises `SessionError` otherwise: a session's
    user has sudo in its container, which without user namespaces is root on
    the host.
    """
    names = set()
    for option in info.get("SecurityOptions") or []:
        # "name=userns" since API 1.26, a bare "userns" before
        fields = dict(part.partition("=")[::2] for part in str(option).split(","))
        names.add(fields.get("name", str(option)))
    if not names & USER_NAMESPACE_OPTIONS:
        raise SessionError(
            "the Docker engine runs without user namespaces; set userns-remap (for example "
            '"userns-remap": "default" in /etc/docker/daemon.json) and restart Docker, or run '
            "Docker rootless: without them a session's root is root on the host"
        )
