"""The one gateway to the Docker engine: every call goes through `Engine`.

Each call is logged (with the session key when there is one, never with
secrets: payloads are not logged) and Docker's errors are mapped once:

- the engine does not answer (no socket, refused, timed out) → `RuntimeUnavailable`;
- removing what is already gone (404) or already being removed (409) → success;
- anything else the engine refuses → `EngineRefused` (a `SessionError`) with its reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions

from gpuresa.runtime.errors import RuntimeUnavailable, SessionError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 120.0


class EngineRefused(SessionError):
    """The engine answered with an error; `status` is its HTTP status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(EngineRefused):
    """What was asked for does not exist (HTTP 404)."""


def _explanation(error: docker.errors.APIError) -> str:
    explanation = error.explanation
    if isinstance(explanation, bytes):
        explanation = explanation.decode(errors="replace")
    return str(explanation or error).strip()


def _removal_in_progress(error: docker.errors.APIError) -> bool:
    text = _explanation(error).lower()
    return error.status_code == 409 and ("in progress" in text or "removing" in text)


class Engine:
    """A small, logged, error-mapped view of the Docker API that gpuresa uses.

    Given an existing `docker.DockerClient`, or None to connect lazily through
    the environment (DOCKER_HOST, else the local socket) on the first call, so
    that making an `Engine` never fails while the engine is away.
    """

    def __init__(self, client: Any | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._client = client
        self.timeout = timeout

    # --- plumbing ---------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                self._client = docker.from_env(timeout=int(self.timeout))
            except docker.errors.DockerException as error:
                raise RuntimeUnavailable(f"the Docker engine does not answer: {error}") from None
        return self._client

    @property
    def api(self) -> Any:
        return self.client.api

    @contextlib.contextmanager
    def _mapped(self, what: str, key: str | None = None) -> Iterator[None]:
        """Run one engine call, logging it and mapping Docker's errors (see the module)."""
        started = time.monotonic()
        log.debug("%sdocker: %s", f"{key}: " if key else "", what)
        try:
            yield
        except docker.errors.NotFound as error:
            raise NotFound(f"Docker: cannot {what}: {_explanation(error)}", 404) from None
        except docker.errors.APIError as error:
            raise EngineRefused(
                f"Docker refused to {what}: {_explanation(error)}", error.status_code
            ) from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as error:
            raise RuntimeUnavailable(
                f"the Docker engine did not answer ({what}): {error}"
            ) from None
        except docker.errors.DockerException as error:
            # the SDK refused the request itself (a bad argument): not the engine's absence
            raise EngineRefused(f"Docker: cannot {what}: {error}") from None
        finally:
            elapsed = time.monotonic() - started
            if elapsed > 5:
                log.info("%sdocker: %s took %.1f s", f"{key}: " if key else "", what, elapsed)

    def _call(
        self, what: str, key: str | None, function: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        with self._mapped(what, key):
            return function(*args, **kwargs)

    # --- engine --------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """`docker info`."""
        result: dict[str, Any] = self._call("read the engine's info", None, self.api.info)
        return result

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
        with self._mapped(what):
            stream = self.api.build(
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
        result = self._call(
            f"create network {name}",
            key,
            self.api.create_network,
            name,
            driver="bridge",
            check_duplicate=True,
            labels=dict(labels),
        )
        return str(result["Id"])

    def networks(self, filters: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Networks matching `filters` (Docker's filter syntax)."""
        result: list[dict[str, Any]] = self._call(
            "list networks", None, self.api.networks, filters=dict(filters)
        )
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

    def inspect(self, container: str, key: str | None = None) -> dict[str, Any] | None:
        """`docker inspect` of a container, or None when there is none."""
        try:
            result: dict[str, Any] = self._call(
                f"inspect container {container}", key, self.api.inspect_container, container
            )
        except NotFound:
            return None
        return result

    def create_container(self, name: str, payload: Mapping[str, Any], key: str) -> str:
        """Create a container from a raw API payload (see `payload.py`); returns its id."""
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
            with self._mapped(f"remove container {container}", key):
                try:
                    self.api.remove_container(container, force=True)
                except docker.errors.APIError as error:
                    if error.status_code == 404:
                        raise
                    if not _removal_in_progress(error):
                        raise
                    log.debug("%s: container %s is already being removed", key, container)
        except NotFound:
            log.debug("%s: container %s was already gone", key, container)

    def execute(
        self, container: str, command: Sequence[str], key: str, user: str = ""
    ) -> tuple[int, str]:
        """Run `command` in a running container; returns its exit code and output."""
        what = f"run {command[0]} in {container}"
        with self._mapped(what, key):
            created = self.api.exec_create(container, list(command), user=user)
            output = self.api.exec_start(created["Id"])
            code = self.api.exec_inspect(created["Id"]).get("ExitCode")
        text = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
        return (int(code) if code is not None else -1), text

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

    def logs(self, container: str, lines: int = 30) -> str:
        """The last `lines` lines a container wrote; empty when it cannot be read."""
        try:
            output = self._call(
                f"read the log of {container}", None, self.api.logs, container, tail=lines
            )
        except EngineRefused:
            return ""
        return output.decode(errors="replace") if isinstance(output, bytes) else str(output)


def dumps(value: Any) -> str:
    """JSON of an API payload with secrets masked, for debug logs."""

    def mask(item: Any) -> Any:
        if isinstance(item, dict):
            return {key: mask(value) for key, value in item.items()}
        if isinstance(item, list):
            return [mask(value) for value in item]
        if isinstance(item, str) and item.startswith("FTP_PASSWORD="):
            return "FTP_PASSWORD=***"
        return item

    return json.dumps(mask(value), sort_keys=True)
