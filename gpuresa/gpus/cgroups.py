"""What the host's /proc and cgroup files say about GPU processes and containers.

Read-only, from the host: nothing here runs inside a container, so nothing a
user controls (users are root in their sessions and may replace any binary
there) is ever executed.

- `container_of(pid)`: the container a process belongs to, from
  /proc/<pid>/cgroup (cgroups v1 and v2; Docker's cgroupfs and systemd
  drivers, Podman's libpod scopes).
- `process_owner(pid)`: the host user that runs a process.
- `device_access(container_id, devices)`: whether a container's device cgroup
  still lets it open the given character devices. This is how a GPU lost
  inside a session is seen: a host `systemctl daemon-reload` rewrites the
  device rules of Docker's cgroups without the NVIDIA nodes, and from then on
  NVML in the container fails ("Failed to initialize NVML: Unknown Error").
  On cgroups v1 the rules are the container's `devices.list`. On cgroups v2
  they are an eBPF program that no file shows; the answer is then None
  (unknown), and no session is ever recreated on a guess.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# docker/<id> (cgroupfs driver), docker-<id>.scope (systemd driver), libpod-<id>.scope (Podman)
_CONTAINER_IN_CGROUP = re.compile(r"(?:docker|libpod)[-/]([0-9a-f]{64})(?:\.scope)?(?:/|$)")
# a udocker session's cgroup (gpuresa's own: gpuresa/<host>@<installation>/<session>), named
# by that path
_SESSION_CGROUP = re.compile(r"^/(gpuresa/[^/]+/[^/]+)(?:/|$)")
# where Docker and Podman put a container's device cgroup under cgroups v1
_DEVICE_CGROUP_LAYOUTS = (
    "docker/{id}",
    "system.slice/docker-{id}.scope",
    "machine.slice/libpod-{id}.scope",
)


def container_of(pid: int, proc: Path = PROC) -> str | None:
    """The full id of the container that process `pid` runs in; None for a host process.

    None too when the process is gone or its cgroup file cannot be read.
    """
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return container_in_cgroup_file(text)


def container_in_cgroup_file(text: str) -> str | None:
    """The container id that a /proc/<pid>/cgroup text names, if any (v1 or v2 lines); for a
    udocker session's process, its session cgroup's path (`gpuresa/<host folder>/<session>`)."""
    for line in text.splitlines():
        # "hierarchy-id:controllers:path"; the path may itself hold ':'
        parts = line.split(":", 2)
        if len(parts) == 3:
            match = _CONTAINER_IN_CGROUP.search(parts[2])
            if match:
                return match.group(1)
            session = _SESSION_CGROUP.match(parts[2])
            if session and "pids" in parts[1].split(","):
                return session.group(1)
    return None


@dataclass(frozen=True)
class ProcessOwner:
    """Who runs a process on the host: login (or "uid N" without a passwd entry) and command."""

    uid: int | None
    user: str
    command: str


def process_owner(pid: int, proc: Path = PROC) -> ProcessOwner:
    """The host user and command name of `pid`; "unknown" fields when it is gone."""
    uid: int | None = None
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])  # the real uid
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        command = (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        command = "unknown"
    if uid is None:
        return ProcessOwner(None, "unknown", command)
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    return ProcessOwner(uid, user, command)


def device_numbers(path: Path) -> tuple[int, int] | None:
    """(major, minor) of the character device at `path` on the host, None when absent."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return os.major(status.st_rdev), os.minor(status.st_rdev)


def cgroup_version(root: Path = CGROUP_ROOT) -> int:
    """2 on a unified (v2-only) hierarchy, else 1."""
    return 2 if (root / "cgroup.controllers").exists() else 1


def _rule_allows(rule: str, major: int, minor: int) -> bool:
    """Whether one devices.list line ("c 195:0 rwm", "a *:* rwm") lets a char device be opened."""
    parts = rule.split()
    if not parts:
        return False
    if parts[0] == "a":
        # "a" means every device with every access
        return True
    if len(parts) != 3 or parts[0] != "c":
        return False
    rule_major, _, rule_minor = parts[1].partition(":")
    return (
        rule_major in ("*", str(major))
        and rule_minor in ("*", str(minor))
        and "r" in parts[2]
        and "w" in parts[2]
    )


def device_access(
    container_id: str, devices: Iterable[tuple[int, int]], root: Path = CGROUP_ROOT
) -> bool | None:
    """Whether container `container_id` may still open every (major, minor) char device.

    True or False from its cgroup v1 `devices.list`; None when that cannot be
    known: cgroups v2 (device rules are an eBPF program), or no device cgroup
    of that container in a known layout (gone, or an unusual cgroup parent).
    """
    if cgroup_version(root) == 2:
        return None
    for layout in _DEVICE_CGROUP_LAYOUTS:
        rules_file = root / "devices" / layout.format(id=container_id) / "devices.list"
        try:
            rules = rules_file.read_text().splitlines()
        except OSError:
            continue
        return all(
            any(_rule_allows(rule, major, minor) for rule in rules) for major, minor in devices
        )
    return None
