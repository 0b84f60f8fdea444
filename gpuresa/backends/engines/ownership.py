"""Whose a container or network is: this installation's, another's, or an older one's.

A daemon acts only on what its own installation made (see `identity`). An
object labelled with another installation's identity is never stopped,
removed or adopted. One with no installation label was made before the label
existed: it is this installation's only when the session's folder of host
files (`<state_dir>/sessions/<key>`, root's, made by this installation when it
prepared that session) is here, and its main container mounts that very folder;
anything else is left alone and reported like another installation's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpuresa.backends.engines.lookup import by_role, session_from
from gpuresa.model import Session
from gpuresa.sessions.labels import (
    INSTALLATION_LABEL,
    KEY_LABEL,
    MAIN_ROLE,
    ROLE_LABEL,
    safe_key,
)

# what `split` calls an unlabelled session it does not adopt
UNLABELLED = "unlabelled"


def labels_of(item: Mapping[str, Any]) -> dict[str, str]:
    """The labels of a container's `inspect` or of a network's listing."""
    labels = item.get("Config", {}).get("Labels") if "Config" in item else item.get("Labels")
    return dict(labels or {})


def split(
    containers: Iterable[dict[str, Any]], installation: str, sessions_root: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """This installation's session containers and everyone else's, from one host's listing.

    Given full `inspect` outputs, this installation's label value and its
    folder of session files. Unlabelled containers are grouped by session key
    and adopted together or not at all (see the module).
    """
    mine: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    unlabelled: dict[str, list[dict[str, Any]]] = {}
    for container in containers:
        labels = labels_of(container)
        if KEY_LABEL not in labels:
            # no session's (the host's output service): neither side's to act on here
            continue
        owner = labels.get(INSTALLATION_LABEL)
        if owner == installation:
            mine.append(container)
        elif owner:
            others.append(container)
        else:
            unlabelled.setdefault(labels[KEY_LABEL], []).append(container)
    for key, members in unlabelled.items():
        if made_here(members, sessions_root / safe_key(key)):
            mine.extend(members)
        else:
            others.extend(members)
    return mine, others


def network_is_mine(network: Mapping[str, Any], installation: str) -> bool:
    """Whether a network may be removed by this installation: its own, or unlabelled.

    An unlabelled network is a leftover of an older version; nothing of
    another installation's lacks the label, and a network in use is refused
    by the engine anyway.
    """
    owner = labels_of(network).get(INSTALLATION_LABEL)
    return not owner or owner == installation


def made_here(containers: Iterable[Mapping[str, Any]], folder: Path) -> bool:
    """Whether unlabelled containers of one session were made by this installation.

    Its session folder `folder` exists, and every main container among them
    mounts it (a sidecar mounts none of it).
    """
    if not folder.is_dir():
        return False
    for container in containers:
        if labels_of(container).get(ROLE_LABEL) != MAIN_ROLE:
            continue
        sources = {Path(str(mount.get("Source", ""))) for mount in container.get("Mounts") or []}
        if not any(source == folder or folder in source.parents for source in sources):
            return False
    return True


def sessions_of_others(containers: Iterable[dict[str, Any]]) -> list[Session]:
    """The sessions that containers of other installations make up, by start then key.

    Grouped by installation and key (two installations may use one key);
    unreadable ones are left out.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for container in containers:
        labels = labels_of(container)
        owner = labels.get(INSTALLATION_LABEL, "")
        groups.setdefault((owner, labels.get(KEY_LABEL, "")), []).append(container)
    found = []
    for (_, key), members in groups.items():
        session = session_from(key, by_role(members), None)
        if session is not None:
            found.append(session)
    return sorted(found, key=lambda session: (session.start, session.key))
