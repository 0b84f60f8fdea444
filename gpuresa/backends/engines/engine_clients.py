"""The Docker SDK clients of an `engine.Engine`: the one given, else one per thread.

docker-py's HTTP session is not safe to share between threads (seen here:
"Bad file descriptor" when eight sessions were prepared at once), so each
thread that calls the engine gets a client of its own, made with the API
version the first one learnt: only the first asks the engine for it.
"""

from __future__ import annotations

import threading
from typing import Any

import docker
import docker.errors

from gpuresa.backends.engines.engine_errors import timed_out
from gpuresa.sessions.errors import EngineTimeout, RuntimeUnavailable

# Connections kept to the engine: more than the threads that call it at once.
POOL_SIZE = 32


class ThreadClients:
    """The clients of one engine: `client` shared when given, else made per thread on first use.

    Given the caller's `docker.DockerClient` or None, the seconds a call may
    take, and the engine's socket URL (None: the environment's DOCKER_HOST,
    else the local socket). Making one never connects.
    """

    def __init__(self, client: Any | None, timeout: float, base_url: str | None) -> None:
        self._client = client
        self._local = threading.local()
        self._version: str | None = None
        self.timeout = timeout
        self.base_url = base_url
        self._connecting = threading.Lock()

    def get(self) -> Any:
        """The calling thread's `docker.DockerClient`, made on first use.

        Raises `RuntimeUnavailable` when the engine cannot be reached, and
        `EngineTimeout` when it takes the connection but does not answer.
        """
        if self._client is not None:
            return self._client
        client = getattr(self._local, "client", None)
        if client is None:
            with self._connecting:
                client = self._connect()
                # the API version, asked once: later threads' clients need not ask again
                self._version = self._version or str(client.api.api_version)
            self._local.client = client
        return client

    def _connect(self) -> Any:
        try:
            version = self._version or "auto"
            if self.base_url is not None:
                return docker.DockerClient(
                    base_url=self.base_url,
                    timeout=self.timeout,
                    max_pool_size=POOL_SIZE,
                    version=version,
                )
            return docker.from_env(timeout=self.timeout, max_pool_size=POOL_SIZE, version=version)
        except docker.errors.DockerException as error:
            if timed_out(error):
                raise EngineTimeout(
                    f"the Docker engine did not answer within {self.timeout:g} s: {error}"
                ) from None
            raise RuntimeUnavailable(f"the Docker engine does not answer: {error}") from None
