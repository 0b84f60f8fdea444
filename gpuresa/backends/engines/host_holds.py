"""What gpuresa holds in the host's kernel outside the engines, and letting go of it.

Sessions leave traces that neither an engine's listing nor the output
folders show: the running area's mount (`outputs.running_area`), each capped output's
image mounted through a loop device (`outputs.capped`), each capped writable
layer's loop device (`layers`), the users' homes and each session's view of one
(`homes.store`), the network namespaces Podman keeps under /run/netns, and
the cgroup folders of udocker sessions (`sessions.cgroup_folders`).
A session that ends takes its own with it; what is left when no running
session needs it keeps its folder busy (it cannot be removed,
`EBUSY`), a loop device taken and, for an image, its blocks held.

`holdings` lists them; `release` lets go of those no running session needs:
the daemon calls it when it stops, `gpuresa host release --all` after
stopping every session. Each step is idempotent: what is already gone counts
as released.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuresa.backends.engines.identity import installation_label
from gpuresa.backends.engines.layers import LAYERS_FOLDER
from gpuresa.config.sections import Config
from gpuresa.homes.paths import MOUNTED_FOLDER, VIEWS_FOLDER, homes_area
from gpuresa.outputs.running_area import (
    area,
    mount_points,
    release_area,
    store,
    unmount,
)
from gpuresa.sessions.cgroup_folders import host_folder, leftovers, remove_folder
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)

NETNS_FOLDER = Path("/run/netns")
# the names Podman gives the namespaces it makes: an admin's own (`ip netns add`) are not ours
PODMAN_NETNS = re.compile(r"^netns-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# a namespace younger than this may be one an engine is setting up for a container
# whose process is not there yet
NETNS_MIN_AGE = 60.0
DELETED = " (deleted)"
COMMAND_TIMEOUT = 30

Kind = Literal["mount", "loop", "netns", "cgroup"]


@dataclass(frozen=True)
class Holding:
    """One thing held: a mount point, a loop device, a network namespace or a cgroup folder.

    `key` is the safe key of the session it belongs to, when it tells (an
    output image, a session's cgroup), else None (the area, a layer's device,
    a namespace, the host's cgroup folder).
    """

    kind: Kind
    what: str
    key: str | None = None
    # a layer's loop device still mounted (an engine's container runs on it), or a
    # cgroup a process is in
    in_use: bool = False

    def __str__(self) -> str:
        return f"{self.kind} {self.what}"


def holdings(config: Config) -> list[Holding]:
    """What this host holds for gpuresa now: area and image mounts, loop devices, namespaces,
    cgroup folders."""
    mountinfo = Path("/proc/self/mountinfo").read_text()
    # a udocker host's alone (the engines make none); this installation's, by its folder
    udocker = any(h.name == config.daemon.host and h.engine == "udocker" for h in config.hosts)
    found: dict[str, bool] = {}
    if udocker:
        base = host_folder(config.daemon.host, installation_label(config.daemon.state_dir))
        found = leftovers(base)
    cgroups = [
        Holding("cgroup", relative, _cgroup_key(relative), in_use)
        for relative, in_use in found.items()
    ]
    return [*_mounts(config, mountinfo), *_loops(config, mountinfo), *_namespaces(), *cgroups]


def _cgroup_key(relative: str) -> str | None:
    """The session's safe key of "gpuresa/<host folder>/<key>"; None for the host's folder."""
    parts = Path(relative).parts
    return parts[2] if len(parts) == 3 else None


def release(
    config: Config, running: Collection[str], *, everything: bool = False
) -> tuple[list[Holding], list[Holding]]:
    """Let go of what the sessions `running` (their keys) do not need; returns (kept, released).

    With `everything`, nothing is kept (the caller has stopped every session).
    A failure to release one thing is logged and that thing is kept.
    """
    needed = {safe_key(key) for key in running}
    kept: list[Holding] = []
    released: list[Holding] = []
    found = holdings(config)

    def keep(holding: Holding) -> bool:
        if holding.kind == "cgroup":
            # a process in it is a session's (never killed here); the host's folder goes
            # once no session needs one
            if holding.in_use:
                return True
            if holding.key is None and any(k.kind == "cgroup" for k in kept):
                return True  # a session's folder kept (listed before) is in it
            return not everything and (
                holding.key in needed if holding.key is not None else bool(needed)
            )
        if everything or holding.kind == "netns":
            return False
        if holding.kind == "loop" and holding.key is None:
            return holding.in_use
        if holding.key is None:  # the area itself
            return bool(needed)
        return holding.key in needed

    for holding in sorted(found, key=_order):
        if keep(holding):
            kept.append(holding)
            continue
        try:
            _let_go(config, holding)
        except OSError as error:
            log.warning("cannot release %s: %s", holding, error)
            kept.append(dataclasses.replace(holding, in_use=True))  # whatever holds it
            continue
        released.append(holding)
    return kept, released


def _order(holding: Holding) -> tuple[int, int]:
    """Mounts first, deepest first (an image's mount sits on the area), then their devices."""
    kinds = ("mount", "loop", "netns", "cgroup")
    return (kinds.index(holding.kind), -len(Path(holding.what).parts))


def _let_go(config: Config, holding: Holding) -> None:
    if holding.kind == "mount":
        point = Path(holding.what)
        if point == area(config):
            release_area(config)
        else:
            while point in mount_points(Path("/proc/self/mountinfo").read_text()):
                unmount(point)
    elif holding.kind == "loop":
        _run("losetup", "-d", holding.what)
    elif holding.kind == "cgroup":
        remove_folder(holding.what)
    else:
        entry = NETNS_FOLDER / holding.what
        with contextlib.suppress(OSError):
            unmount(entry)
        entry.unlink(missing_ok=True)


def _mounts(config: Config, mountinfo: str) -> list[Holding]:
    """The area's mount and every mount at or below the area or the store (images); the
    users' homes mounted and each session's view of one (`homes.store`)."""
    running, stored = area(config).resolve(), store(config).resolve()
    homes = homes_area(config).resolve()
    found = []
    for point in dict.fromkeys(mount_points(mountinfo)):
        if point == running or point.parent == homes / MOUNTED_FOLDER:
            found.append(Holding("mount", str(point)))
        elif point.parent.parent == homes / VIEWS_FOLDER:
            found.append(Holding("mount", str(point), point.name))
        elif point.parent in (running, stored):
            # `<key>` at either place, or a copy's reader `.<key>.copy`
            name = point.name.removeprefix(".").removesuffix(".copy")
            found.append(Holding("mount", str(point), name))
    return found


def _loops(config: Config, mountinfo: str) -> list[Holding]:
    """Loop devices backed by an output image of the store or a layer of the state folder."""
    try:
        text = subprocess.run(
            ["losetup", "-J"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True
        ).stdout
        devices = json.loads(text or "{}").get("loopdevices", [])
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        log.warning("cannot list the loop devices: %s", error)
        return []
    mounted = {line.split(" - ")[1].split()[1] for line in mountinfo.splitlines() if " - " in line}
    images = store(config).resolve()
    layers = (config.daemon.state_dir / LAYERS_FOLDER).resolve()
    found = []
    for device in devices:
        name = str(device.get("name", ""))
        backing = Path(str(device.get("back-file") or "").removesuffix(DELETED))
        if backing.parent == images and backing.suffix == ".img":
            found.append(Holding("loop", name, backing.stem))
        elif backing.parent == layers:
            found.append(Holding("loop", name, in_use=name in mounted))
    return found


def _namespaces() -> list[Holding]:
    """Named network namespaces (Podman's) that no process is in, older than `NETNS_MIN_AGE`:
    the engine's leftovers of a container gone without its clean-up."""
    try:
        entries = [
            entry
            for entry in NETNS_FOLDER.iterdir()
            if PODMAN_NETNS.match(entry.name) and entry.is_file()
        ]
    except OSError:
        return []
    used = _namespaces_in_use()
    named = _named_by_podman() if entries else set()
    if named is None:
        return []  # Podman cannot say which are its containers': none is taken for a leftover
    found = []
    for entry in entries:
        try:
            details = entry.stat()
        except OSError:
            continue
        # a process is in it (or it is being made), or a container Podman has still names it
        # (its process ended a moment ago and Podman's own clean-up, which tears its port
        # forwarding down through it, has yet to run): whoever's it is, it is no leftover
        if entry.name in named or details.st_ino in used:
            continue
        if time.time() - details.st_mtime >= NETNS_MIN_AGE:
            found.append(Holding("netns", entry.name))
    return found


def _named_by_podman() -> set[str] | None:
    """The names of the namespaces Podman's containers (of anyone, in any state) name; None
    when Podman does not answer. A machine without Podman has none."""
    try:
        listed = _podman("ps", "--all", "--quiet", "--no-trunc")
        if listed is None or not listed.split():
            return None if listed is None else set()
        keys = _podman(
            "inspect", "--type", "container", "--format", "{{.NetworkSettings.SandboxKey}}",
            *listed.split(),
        )  # fmt: skip
    except FileNotFoundError:
        return set()
    # a container removed between the two calls makes `inspect` fail: ask again next time
    return None if keys is None else {Path(key).name for key in keys.split() if key}


def _podman(*arguments: str) -> str | None:
    """`podman`'s output; None when it fails or hangs. Raises `FileNotFoundError` without it."""
    try:
        result = subprocess.run(
            ["podman", *arguments], capture_output=True, text=True, timeout=COMMAND_TIMEOUT
        )
    except FileNotFoundError:
        raise
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _namespaces_in_use() -> set[int]:
    """The inode numbers of the network namespaces some process is in."""
    used = set()
    for process in Path("/proc").iterdir():
        if process.name.isdigit():
            with contextlib.suppress(OSError):
                used.add(os.stat(process / "ns" / "net").st_ino)
    return used


def _run(*command: str) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OSError(f"{command[0]}: {error}") from None
    if result.returncode != 0 and "No such device" not in result.stderr:
        raise OSError(f"{' '.join(command)}: {result.stderr.strip() or result.returncode}")


def release_unneeded(config: Config, running: Collection[str] | None) -> list[Holding]:
    """At a daemon's stop: release what the sessions `running` (keys) do not need; returns
    what is kept, and says so in one line. None (the sessions could not be listed) keeps all.
    """
    if running is None:
        kept = holdings(config)
        released: list[Holding] = []
    else:
        kept, released = release(config, running)
    if released:
        log.info("released what no running session needs: %s", ", ".join(map(str, released)))
    if kept:
        whom = (
            "what runs is not known now"
            if running is None
            else f"{len(running)} running session(s)"
        )
        log.info("kept on the host (%s): %s", whom, ", ".join(map(str, kept)))
    return kept
