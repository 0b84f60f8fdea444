"""The one gateway to the Docker engine: every call goes through `Engine`.

Each call is logged (with the session key when there is one, never with
secrets: payloads are not logged), bounded in time, and Docker's errors are
mapped once (`engine_errors.mapped_errors` says to what).

Runtime methods run on several threads at once: each thread gets a client
of its own (see `engine_clients`).
"""

from __future__ import annotations

import io
import logging
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import docker
import docker.errors

from gpuresa.backends.engines.engine_clients import ThreadClients
from gpuresa.backends.engines.engine_errors import (
    EngineRefused,
    NotFound,
    again_if_interface_vanished,
    dumps,
    explanation,
    mapped_errors,
    removal_in_progress,
)
from gpuresa.sessions.errors import EngineTimeout, PortRefused

log = logging.getLogger(__name__)

# tries at removing a container whose mounts the engine finds busy (see remove_container)
REMOVAL_ATTEMPTS = 5

T = TypeVar("T")

# Seconds one engine call may take; a call that takes longer has failed.
DEFAULT_TIMEOUT = 30.0
# Builds stream their log for as long as the template's steps run.
BUILD_TIMEOUT = 3600.0

__all__ = ["Engine", "EngineRefused", "EngineTimeout", "NotFound", "PortRefused", "dumps"]


class Engine:
    """A small, logged, error-mapped view of the Docker API that gpuresa uses.

    Given an existing `docker.DockerClient`, or None to connect lazily through
    the environment (DOCKER_HOST, else the local socket) on the first call, so
    that making an `Engine` never fails while the engine is away.
    """

    def __init__(
        self,
        client: Any | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        base_url: str | None = None,
        build_timeout: float = BUILD_TIMEOUT,
    ) -> None:
        self._clients = ThreadClients(client, timeout, base_url)
        self.timeout = timeout
        self.build_timeout = build_timeout
        self.base_url = base_url

    # --- plumbing ---------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The `docker.DockerClient` of the calling thread (see `engine_clients.ThreadClients`).

        Raises `RuntimeUnavailable` when the engine cannot be reached, and
        `EngineTimeout` when it takes the connection but does not answer.
        """
        return self._clients.get()

    @property
    def api(self) -> Any:
        return self.client.api

    def _call(
        self, what: str, key: str | None, function: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        with mapped_errors(what, key):
            return function(*args, **kwargs)

    # --- engine --------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """`docker info`."""
        result: dict[str, Any] = self._call("read the engine's info", None, self.api.info)
        return result

    def version(self) -> dict[str, Any]:
        """`docker version`: the engine's name and versions (`Components`)."""
        result: dict[str, Any] = self._call("read the engine's version", None, self.api.version)
        return result

    def libpod(self, path: str, key: str | None = None) -> Any:
        """GET `path` of Podman's own API (`/v4.0.0/libpod/...`); its decoded JSON.

        Podman's Docker-compatible API leaves out what only Podman has (a
        container's ID mappings, whether the service is rootless); its own API
        reached through the same socket and client tells them. Raises
        `NotFound` (404) and `EngineRefused` like every other call.
        """
        api = self.api

        def get() -> Any:
            # the SDK builds Docker's versioned URLs; Podman's API has versions of its own
            response = api._get(f"{api.base_url}/v4.0.0/libpod/{path.lstrip('/')}")
            return api._result(response, json=True)

        return self._call(f"read Podman's {path}", key, get)

    # --- images -------------------------------------------------------------------------

    def image_id(self, reference: str) -> str | None:
        """The id of the local image `reference`, or None when it is not here."""
        try:
            attributes = self._call(
                f"inspect image {reference}", None, self.api.inspect_image, reference
            )
        except NotFound:
            return None
        return str(attributes["Id"])

    def save_image(self, reference: str, target: str) -> None:
        """Write image `reference` as a `docker save` archive to the file `target` (slow)."""
        with mapped_errors(f"save image {reference}"), open(target, "wb") as archive:
            for chunk in self.api.get_image(reference):
                archive.write(chunk)

    def images(self, filters: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Summaries (Id, RepoTags, Labels…) of the local images matching `filters`."""
        result: list[dict[str, Any]] = self._call(
            "list images", None, self.api.images, filters=dict(filters)
        )
        return result

    def remove_image(self, reference: str) -> bool:
        """Remove an image tag (its layers too when nothing else uses them).

        Returns False when a container still uses it (nothing removed); an
        image already gone counts as removed.
        """
        try:
            self._call(f"remove image {reference}", None, self.api.remove_image, reference)
        except NotFound:
            return True
        except EngineRefused as error:
            if error.status == 409:
                log.info("image %s is in use; kept", reference)
                return False
            raise
        return True

    def pull(self, reference: str) -> str:
        """Pull `reference` (name:tag, "latest" when no tag is given) from its registry.

        Returns the image's id.
        """
        self._call(f"pull {reference}", None, self.api.pull, reference)
        image = self.image_id(reference)
        if image is None:
            raise EngineRefused(f"Docker pulled {reference} but does not list it")
        return image

    def build(
        self,
        context: bytes,
        tag: str | None,
        build_arguments: Mapping[str, str],
        labels: Mapping[str, str],
    ) -> str:
        """Build an image from a tar `context`; returns its id.

        Raises `EngineRefused` with the end of the build log when a step fails.
        """
        what = f"build {tag or 'an image'}"
        lines: list[str] = []
        image: str | None = None
        with mapped_errors(what):
            stream = self.api.build(
                timeout=int(self.build_timeout),
                fileobj=io.BytesIO(context),
                custom_context=True,
                tag=tag,
                buildargs=dict(build_arguments),
                labels=dict(labels),
                rm=True,
                forcerm=True,
                pull=False,
                decode=True,
            )
            for chunk in stream:
                if "error" in chunk:
                    lines.append(str(chunk["error"]).strip())
                    tail = "\n".join(lines[-15:])
                    raise EngineRefused(f"Docker could not {what}:\n{tail}")
                text = str(chunk.get("stream", "")).rstrip()
                if text:
                    lines.append(text)
                    log.debug("build %s: %s", tag, text)
                aux = chunk.get("aux")
                if isinstance(aux, Mapping) and "ID" in aux:
                    image = str(aux["ID"])
                elif text.startswith("Successfully built "):
                    image = image or text.split()[-1]
        if image is None:
            tail = "\n".join(lines[-15:])
            raise EngineRefused(f"Docker could not {what} (no image id in its output):\n{tail}")
        return image

    # --- networks -----------------------------------------------------------------------

    def create_network(self, name: str, labels: Mapping[str, str], key: str) -> str:
        """Create a bridge network `name`, or return the one that exists with that name."""
        existing = self.networks({"name": name})
        for network in existing:
            if network.get("Name") == name:
                return str(network["Id"])
        result = again_if_interface_vanished(
            lambda: self._call(f"create network {name}", key, self.api.create_network, name,
                               driver="bridge", check_duplicate=True, labels=dict(labels))
        )  # fmt: skip
        return str(result["Id"])

    def networks(self, filters: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Networks matching `filters` (Docker's filter syntax)."""
        result: list[dict[str, Any]] = self._call(
            "list networks", None, self.api.networks, filters=dict(filters)
        )
        return result

    def network(self, network: str) -> dict[str, Any] | None:
        """`docker network inspect`, or None when there is no such network."""
        try:
            result: dict[str, Any] = self._call(
                f"inspect network {network}", None, self.api.inspect_network, network
            )
        except NotFound:
            return None
        return result

    def remove_network(self, network: str, key: str | None = None) -> None:
        """Remove a network; already gone counts as done."""
        try:
            self._call(f"remove network {network}", key, self.api.remove_network, network)
        except NotFound:
            log.debug("%s: network %s was already gone", key, network)

    # --- containers ---------------------------------------------------------------------

    def containers(self, filters: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Full `inspect` of every container (running or not) matching `filters`."""
        summaries = self._call(
            "list containers", None, self.api.containers, all=True, filters=dict(filters)
        )
        found = []
        for summary in summaries:
            attributes = self.inspect(summary["Id"])
            if attributes is not None:
                found.append(attributes)
        return found

    def container_summaries(self, filters: Mapping[str, Any]) -> list[dict[str, Any]]:
        """`docker ps -a` entries (Id, Names, ImageID, Labels, State) matching `filters`."""
        result: list[dict[str, Any]] = self._call(
            "list containers", None, self.api.containers, all=True, filters=dict(filters)
        )
        return result

    def inspect(self, container: str, key: str | None = None) -> dict[str, Any] | None:
        """`docker inspect` of a container, or None when there is none."""
        try:
            result: dict[str, Any] = self._call(
                f"inspect container {container}", key, self.api.inspect_container, container
            )
        except NotFound:
            return None
        except EngineRefused as error:
            # Podman answers 500, not 404, for a container removed since it was listed
            if "no such container" in str(error).lower():
                return None
            raise
        return result

    def create_container(self, name: str, payload: Mapping[str, Any], key: str) -> str:
        """Create a container from a raw API payload (see `create_payloads`); returns its id."""
        result = self._call(
            f"create container {name}",
            key,
            self.api.create_container_from_config,
            dict(payload),
            name=name,
        )
        for warning in result.get("Warnings") or []:
            log.info("%s: Docker warns about %s: %s", key, name, warning)
        return str(result["Id"])

    def start_container(self, container: str, key: str) -> None:
        self._call(f"start container {container}", key, self.api.start, container)

    def stop_container(self, container: str, timeout: int, key: str | None = None) -> None:
        """SIGTERM, then SIGKILL after `timeout` s; a container already gone is stopped."""
        try:
            self._call(
                f"stop container {container}", key, self.api.stop, container, timeout=timeout
            )
        except NotFound:
            log.debug("%s: container %s was already gone", key, container)

    def remove_container(self, container: str, key: str | None = None) -> None:
        """Remove a container (killing it if it runs); gone or being removed counts as done."""
        try:
            with mapped_errors(f"remove container {container}", key):
                for attempt in range(REMOVAL_ATTEMPTS):
                    try:
                        self.api.remove_container(container, force=True)
                        return
                    except docker.errors.APIError as error:
                        if error.status_code == 404:
                            raise
                        if removal_in_progress(error):
                            log.debug("%s: container %s is already being removed", key, container)
                            return
                        busy = "device or resource busy" in explanation(error).lower()
                        if not busy or attempt == REMOVAL_ATTEMPTS - 1:
                            raise
                        # Podman, removing a container it is still killing, may find
                        # its mounts busy for a moment: the next try finds them free
                        log.debug("%s: container %s busy; removing again", key, container)
                        time.sleep(0.2 * (attempt + 1))
        except NotFound:
            log.debug("%s: container %s was already gone", key, container)

    def kill_container(self, container: str, key: str | None = None) -> None:
        """SIGKILL a container's init (and so every process of it); gone or stopped is done."""
        try:
            with mapped_errors(f"kill container {container}", key):
                try:
                    self.api.kill(container, signal="SIGKILL")
                except docker.errors.APIError as error:
                    if error.status_code == 409 and "not running" in explanation(error).lower():
                        return
                    raise
        except NotFound:
            log.debug("%s: container %s was already gone", key, container)

    def execute_detached(self, container: str, command: Sequence[str], key: str) -> None:
        """Start `command` in a running container and return at once, never waiting for it.

        The command's exit and output are never read: what runs in a session
        is the user's, and may never end.
        """
        what = f"start {command[0]} in {container}"
        with mapped_errors(what, key):
            created = self.api.exec_create(container, list(command), stdout=False, stderr=False)
            self.api.exec_start(created["Id"], detach=True)

    def output(self, container: str, key: str | None = None) -> tuple[str, str]:
        """Everything a container wrote so far: its standard output and its standard error."""
        streams = []
        for stdout in (True, False):
            data = self._call(
                f"read the output of {container}",
                key,
                self.api.logs,
                container,
                stdout=stdout,
                stderr=not stdout,
            )
            streams.append(data.decode(errors="replace") if isinstance(data, bytes) else str(data))
        return streams[0], streams[1]

    def logs(self, container: str, lines: int | None = 30, *, strict: bool = False) -> str:
        """The last `lines` lines a container wrote (None: all); empty when unreadable, or
        (`strict`) the engine's error raised."""
        tail = "all" if lines is None else lines
        try:
            output = self._call(
                f"read the log of {container}", None, self.api.logs, container, tail=tail
            )
        except EngineRefused:
            if strict:
                raise
            return ""
        return output.decode(errors="replace") if isinstance(output, bytes) else str(output)

    def read_file(self, container: str, path: str, key: str | None = None) -> bytes | None:
        """The file `path` of `container` (a tar stream, read whole); None when the container
        has no such file. Raises what the engine raises otherwise."""
        try:
            stream, _ = self._call(
                f"read {path} in {container}", key, self.api.get_archive, container, path
            )
            data = b"".join(stream)
        except NotFound:
            return None
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            member = next((item for item in archive.getmembers() if item.isfile()), None)
            handle = archive.extractfile(member) if member is not None else None
            return handle.read() if handle is not None else None
