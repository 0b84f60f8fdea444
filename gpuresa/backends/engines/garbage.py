"""What sessions leave behind when something failed midway: networks, and images of old templates.

A crash between creating a session's network and its containers leaves a
network that no session will remove; every edit of a template leaves its
previous image. Both are collected here, never anything in use: a network
whose session is busy (an action in flight), has a container, or is
attached to one is kept; an image that a container (running or not) uses,
or whose current version cannot be told (its base image is not here), is
kept. Only this host's objects are touched: networks labelled with its
name, images labelled as built for it under `templates.image_prefix`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from datetime import UTC, datetime, timedelta

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.images import BUILT_FOR_LABEL, HASH_LABEL, Images
from gpuresa.backends.engines.ownership import network_is_mine
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import HOST_LABEL, KEY_LABEL, NETWORK_ROLE, ROLE_LABEL

log = logging.getLogger(__name__)


def leaked_networks(
    engine: Engine, host: str, installation: str, busy: Collection[str], min_age: timedelta
) -> list[str]:
    """Remove this installation's session networks of `host` that nothing uses; their names.

    Another installation's networks (see `ownership.network_is_mine`) are never touched.

    A network is kept when its session key is in `busy`, when any container
    of that session exists, when a container is attached to it, or when it
    is younger than `min_age` (another process may be making its session).
    """
    networks = engine.networks({"label": [f"{HOST_LABEL}={host}", f"{ROLE_LABEL}={NETWORK_ROLE}"]})
    if not networks:
        return []
    containers = engine.containers({"label": [f"{HOST_LABEL}={host}"]})
    keys_with_containers = {
        container.get("Config", {}).get("Labels", {}).get(KEY_LABEL) for container in containers
    }
    now = datetime.now(UTC)
    removed = []
    for summary in networks:
        key = (summary.get("Labels") or {}).get(KEY_LABEL)
        if not network_is_mine(summary, installation):
            continue
        if key is None or key in busy or key in keys_with_containers:
            continue
        network = engine.network(str(summary["Id"]))
        if network is None or network.get("Containers"):
            continue
        if now - _created(network.get("Created", "")) < min_age:
            continue
        name = str(network.get("Name") or network["Id"])
        try:
            engine.remove_network(str(network["Id"]), key)
        except SessionError as error:
            # attached to a container since we looked: in use after all
            log.info("%s: network %s kept: %s", key, name, error)
            continue
        log.info("%s: removed leaked network %s", key, name)
        removed.append(name)
    return removed


def old_images(engine: Engine, images: Images, host: str) -> list[str]:
    """Remove the tags of this host's images of old template versions that nothing uses.

    Returns the removed tags. An image is old when its tag (under
    `templates.image_prefix`) is not the current one of any allowed template
    variant or of the FTP sidecar.
    """
    current, unknown = images.current_tags()
    prefix = images.templates.image_prefix.lower() + "/"
    built = engine.images({"label": [HASH_LABEL, f"{BUILT_FOR_LABEL}={host}"]})
    if not built:
        return []
    in_use = {str(container.get("ImageID", "")) for container in engine.container_summaries({})}
    removed = []
    for image in built:
        labels = image.get("Labels") or {}
        variant = (labels.get("gpuresa.template", ""), labels.get("gpuresa.cuda", ""))
        if variant in unknown or str(image["Id"]) in in_use:
            continue
        for tag in image.get("RepoTags") or []:
            if not tag.startswith(prefix) or tag in current:
                continue
            if engine.remove_image(tag):
                log.info("removed image %s of an old template version", tag)
                removed.append(tag)
    return removed


def _created(text: str) -> datetime:
    """Docker's creation time (RFC 3339, nanoseconds); the epoch when unreadable."""
    # Python reads at most microseconds: drop the fraction, keep the zone
    match = re.fullmatch(r"([0-9T:-]+)(?:\.\d+)?(Z|[+-]\d\d:\d\d)", text.strip())
    if match is None:
        return datetime.fromtimestamp(0, UTC)
    zone = "+00:00" if match.group(2) == "Z" else match.group(2)
    try:
        return datetime.fromisoformat(match.group(1) + zone).astimezone(UTC)
    except ValueError:
        return datetime.fromtimestamp(0, UTC)
