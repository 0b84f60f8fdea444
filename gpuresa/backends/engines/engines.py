"""What differs between the two engines gpuresa drives: Docker and Podman.

Both are driven through the Docker API (Podman serves a compatible one on its
socket), by the same `Engine` gateway and the same payloads. What differs is
how a session gets its user namespace, and so which host ids its files have:

- Docker runs with `userns-remap`: every container maps its ids onto the one
  range the engine was started with (`docker info` names it), so root in
  every session is the same host uid.
- Podman, rootful, gives each session a user namespace of its own
  (`UsernsMode: "auto:size=65536"`), 65536 ids taken from the `containers`
  range of /etc/subuid and /etc/subgid. The range is chosen when the main
  container is created and read back through Podman's own API (its Docker
  API does not show it) before anything of the user's runs: the output folder
  is given to it, then the FTP sidecar is created with the same mapping forced
  (`uidmapping=`), so a file is the session's on both sides.

Podman differs in three smaller ways, handled here too: unlike Docker it leaves
ports below 1024 privileged in a container's network namespace (sshd needs
22); it gives containers an
open-file and process limit (1048576 and 4194304) that a process in a user
namespace cannot raise itself to unless the service already has them, so the
payload names limits it can have; and its Docker API ignores device requests
before Podman 5.4 (which honours CDI ones), so booked GPUs are checked to be
in the created container, and a container without them is refused rather
than started without its GPUs.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.namespaces import require_user_namespaces
from gpuresa.config.sections import LimitsConfig
from gpuresa.model import IdRange
from gpuresa.outputs.folder import remap_base
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

# ids 0-65535 in every session: the range `access.container_uid` hands logins from
SESSION_ID_COUNT = 65536
PODMAN_SOCKET = "unix:///run/podman/podman.sock"
SUBORDINATE_ID_FILES = (Path("/etc/subuid"), Path("/etc/subgid"))
# the user whose subordinate ids Podman's `--userns=auto` hands out
PODMAN_AUTO_USER = "containers"
# how long a Podman service found rootful is trusted to stay so (see `Podman.check`)
ENGINE_CHECKED_FOR = 60.0


def is_podman(version: Mapping[str, Any]) -> bool:
    """Whether `docker version` output `version` comes from Podman's Docker API."""
    names = [str(part.get("Name", "")) for part in version.get("Components") or []]
    return any(name.startswith("Podman") for name in names)


def subordinate_count(text: str, user: str) -> int:
    """How many ids /etc/subuid (or subgid) text `text` gives `user`, over all its lines."""
    total = 0
    for line in text.splitlines():
        fields = line.strip().split(":")
        if len(fields) == 3 and fields[0] == user and fields[2].isdigit():
            total += int(fields[2])
    return total


def mapped_range(id_mappings: Mapping[str, Any] | None) -> IdRange | None:
    """The session range in Podman's `IDMappings` ({"UidMap": ["0:H:N"], "GidMap": [...]}).

    Returns None unless ids 0 to 65535 map, in one piece each, onto host ids
    other than 0: anything else is not a user namespace gpuresa made.
    """
    if not id_mappings:
        return None
    firsts = []
    for name in ("UidMap", "GidMap"):
        entries = id_mappings.get(name) or []
        if len(entries) != 1:
            return None
        inside, host, count = (int(part) for part in str(entries[0]).split(":"))
        if inside != 0 or host == 0 or count < SESSION_ID_COUNT:
            return None
        firsts.append(host)
    return IdRange(firsts[0], firsts[1], SESSION_ID_COUNT)


class EngineKind:
    """The engine-specific part of the runtime; `Docker` and `Podman` below."""

    name = "engine"
    default_socket: str | None = None
    # whether a service that dies mid-removal can leave a gone container's port forwarding
    # behind (netavark's rules; see `forwarding`)
    leaves_forwarding = False

    def check(self, engine: Engine) -> None:
        """Refuse (`SessionError`) an engine on which sessions would not get user namespaces."""
        raise NotImplementedError

    def main_settings(self, limits: LimitsConfig) -> dict[str, Any]:
        """What the main container's HostConfig adds (before its range is known)."""
        return {}

    def service_settings(self, limits: LimitsConfig) -> dict[str, Any]:
        """What the host's output service's HostConfig adds."""
        return {}

    def sidecar_settings(self, ids: IdRange | None, limits: LimitsConfig) -> dict[str, Any]:
        """What the FTP sidecar's HostConfig adds, given the session's range."""
        return {}

    def created(
        self, engine: Engine, container: str, gpus: Sequence[int], key: str
    ) -> IdRange | None:
        """The range of a main container just created; raises `SessionError` to refuse it."""
        raise NotImplementedError

    def session_range(self, engine: Engine, main: Mapping[str, Any]) -> IdRange | None:
        """The range of an existing session, from its main container's inspect."""
        raise NotImplementedError


class Docker(EngineKind):
    """Docker with `userns-remap`: one range for every session, from `docker info`."""

    name = "docker"

    def __init__(self) -> None:
        self._range: tuple[IdRange | None] | None = None
        self._lock = threading.Lock()

    def check(self, engine: Engine) -> None:
        if is_podman(engine.version()):
            raise SessionError(
                'the engine at this host\'s socket is Podman, not Docker; set engine = "podman" '
                "in its [[hosts]] entry"
            )
        info = engine.info()
        require_user_namespaces(info)
        self._remember(info)

    def _remember(self, info: Mapping[str, Any]) -> IdRange | None:
        uid, gid = remap_base(info)
        ids = IdRange(uid, gid, SESSION_ID_COUNT) if uid and gid else None
        with self._lock:
            self._range = (ids,)
        return ids

    def created(
        self, engine: Engine, container: str, gpus: Sequence[int], key: str
    ) -> IdRange | None:
        return self.session_range(engine, {})

    def session_range(self, engine: Engine, main: Mapping[str, Any]) -> IdRange | None:
        with self._lock:
            known = self._range
        if known is not None:
            return known[0]
        return self._remember(engine.info())


class Podman(EngineKind):
    """Rootful Podman: a user namespace of its own for every session (`userns=auto`).

    `subordinate_files` are /etc/subuid and /etc/subgid (tests give others).
    """

    name = "podman"
    default_socket = PODMAN_SOCKET
    leaves_forwarding = True

    def __init__(self, subordinate_files: Sequence[Path] = SUBORDINATE_ID_FILES) -> None:
        self.subordinate_files = tuple(subordinate_files)
        # a container's mapping never changes: read it once per container
        self._ranges: dict[str, IdRange | None] = {}
        self._lock = threading.Lock()
        # until when (time.monotonic()) the service was last found rootful Podman
        self._rootful_until = 0.0

    def check(self, engine: Engine) -> None:
        # Podman answers `version` in 0.7-1.6 s and `info` in 0.4 s (it runs its helpers to
        # report their versions and sizes its store): half of a session's start when asked
        # each time, so a service found right is trusted for ENGINE_CHECKED_FOR seconds;
        # every main container's own range is checked as it is made (`created`) all the same
        now = time.monotonic()
        with self._lock:
            fresh = now < self._rootful_until
        if not fresh:
            if not is_podman(engine.version()):
                raise SessionError(
                    'the engine at this host\'s socket is not Podman; set engine = "docker" in '
                    "its [[hosts]] entry, or engine_socket to Podman's socket"
                )
            info = engine.libpod("info")
            if info.get("host", {}).get("security", {}).get("rootless", True):
                raise SessionError(
                    "the Podman service runs rootless: it cannot give each session its own "
                    "range of host ids; run the rootful service "
                    "(systemctl enable --now podman.socket)"
                )
            with self._lock:
                self._rootful_until = now + ENGINE_CHECKED_FOR
        for path in self.subordinate_files:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as error:
                raise SessionError(f"cannot read {path}: {error.strerror}") from None
            count = subordinate_count(text, PODMAN_AUTO_USER)
            if count < SESSION_ID_COUNT:
                raise SessionError(
                    f"{path} gives {PODMAN_AUTO_USER!r} {count} ids; Podman's userns=auto needs "
                    f"{SESSION_ID_COUNT} per session (add a line such as "
                    f"'{PODMAN_AUTO_USER}:2000000:4194304' for 64 sessions)"
                )

    def main_settings(self, limits: LimitsConfig) -> dict[str, Any]:
        return {
            "UsernsMode": f"auto:size={SESSION_ID_COUNT}",
            "Ulimits": _ulimits(limits),
            # what Docker sets in every container with a network of its own: sshd
            # binds port 22 without NET_BIND_SERVICE (see create_payloads.MAIN_CAPABILITIES)
            "Sysctls": {"net.ipv4.ip_unprivileged_port_start": "0"},
        }

    def sidecar_settings(self, ids: IdRange | None, limits: LimitsConfig) -> dict[str, Any]:
        if ids is None:
            raise SessionError("the session's id range is not known; the FTP sidecar is not made")
        count = SESSION_ID_COUNT
        mode = f"auto:size={count},uidmapping=0:{ids.uid}:{count},gidmapping=0:{ids.gid}:{count}"
        return {"UsernsMode": mode, "Ulimits": _ulimits(limits)}

    def service_settings(self, limits: LimitsConfig) -> dict[str, Any]:
        # Podman's own default limits are more than its runtime may set (see `_ulimits`)
        return {"Ulimits": _ulimits(limits)}

    def created(
        self, engine: Engine, container: str, gpus: Sequence[int], key: str
    ) -> IdRange | None:
        attributes = engine.libpod(f"containers/{container}/json", key)
        host_config = attributes.get("HostConfig") or {}
        ids = mapped_range(host_config.get("IDMappings"))
        if ids is None:
            raise SessionError(
                f"Podman made container {container} without a user namespace of its own "
                f"(ID mappings {host_config.get('IDMappings')}); refusing to start it"
            )
        inside = {str(device.get("PathInContainer")) for device in host_config.get("Devices") or []}
        missing = [f"/dev/nvidia{index}" for index in gpus if f"/dev/nvidia{index}" not in inside]
        if missing:
            raise SessionError(
                f"Podman made the container without the booked GPUs ({', '.join(missing)}): "
                "its Docker API ignores device requests before Podman 5.4; use gpu_mode = "
                '"devices", or "cdi" with Podman 5.4 or later'
            )
        with self._lock:
            self._ranges[container] = ids
        log.info("%s: user namespace of its own, host ids %s", key, ids)
        return ids

    def session_range(self, engine: Engine, main: Mapping[str, Any]) -> IdRange | None:
        container = str(main.get("Id", ""))
        if not container:
            return None
        with self._lock:
            if container in self._ranges:
                return self._ranges[container]
        attributes = engine.libpod(f"containers/{container}/json")
        ids = mapped_range((attributes.get("HostConfig") or {}).get("IDMappings"))
        with self._lock:
            if len(self._ranges) > 4096:
                self._ranges.clear()  # containers come and go; never grow without end
            self._ranges[container] = ids
        return ids


def _ulimits(limits: LimitsConfig) -> list[dict[str, Any]]:
    """Open files and processes a Podman session's processes may have.

    Podman would ask for more than a user namespace can be given (see the
    module); gpuresa's own open-file limit is what the host's services get
    (gpuresa and the Podman service run side by side), and the process limit
    follows the session's pids limit, counted per host uid, which is the
    session's own on Podman.
    """
    _, open_files = resource.getrlimit(resource.RLIMIT_NOFILE)
    if open_files == resource.RLIM_INFINITY or open_files <= 0:
        open_files = 1048576
    return [
        {"Name": "nofile", "Soft": open_files, "Hard": open_files},
        {"Name": "nproc", "Soft": limits.pids, "Hard": limits.pids},
    ]


def engine_kind(name: str) -> EngineKind:
    """The `EngineKind` for a host's `engine` setting ("docker" or "podman")."""
    if name == "podman":
        return Podman()
    if name == "docker":
        return Docker()
    raise SessionError(f"unknown engine {name!r}; expected 'docker' or 'podman'")
