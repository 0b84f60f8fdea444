"""One-shot workload containers: a command run to its end in a template's image, then removed.

For `gpuresa bench`: the container gets what a session's main container gets
where speed is concerned (the host's GPU mode with the same GPU settings,
`[limits]`, docker-init, dropped capabilities) and nothing a session needs
for people: no network (`none`: loopback only), no SSH, no ports, no output
folder, no login. The image's entrypoint (the access layer's sshd start-up)
is replaced by the command itself.

Its label `gpuresa.bench=<host>` is not a session label (`gpuresa.host`,
`gpuresa.reservation`), so `Runtime.list_sessions()` and the daemon never
take it for a session; `remove_leftovers()` removes those a killed bench left.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpuresa.backends.engines.create_payloads import resource_limits
from gpuresa.backends.engines.engine import Engine
from gpuresa.config.sections import Config
from gpuresa.gpus.access import GpuAccess
from gpuresa.gpus.devices import host_gpu_access
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

BENCH_LABEL = "gpuresa.bench"
# how often a running one-shot container is asked whether it has exited
POLL_INTERVAL = 0.2
# what engine calls are logged with
LOG_KEY = "bench"


class OneShotTimeout(SessionError):
    """The command did not finish in time; its container was removed."""


@dataclass(frozen=True)
class OneShotResult:
    """How a one-shot command ended: exit code, standard output and error, wall-clock seconds."""

    exit_code: int
    stdout: str
    stderr: str
    seconds: float


def oneshot_payload(
    config: Config,
    image: str,
    command: Sequence[str],
    gpu: GpuAccess,
    mounts: Sequence[tuple[Path, PurePosixPath]] = (),
    environment: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The create payload of a one-shot container running `command` in `image`.

    `mounts` are (host folder, container folder) pairs, mounted read-only.
    """
    values = {**(environment or {}), **gpu.environment}
    host_config: dict[str, Any] = {
        "NetworkMode": "none",
        "Mounts": [
            *(
                {"Type": "bind", "Source": str(source), "Target": str(target), "ReadOnly": True}
                for source, target in mounts
            ),
            *gpu.mounts,
        ],
        "Devices": gpu.devices,
        "DeviceRequests": gpu.device_requests,
        "CapDrop": ["ALL"],
        "CapAdd": [],
        "SecurityOpt": ["no-new-privileges:true"],
        "Privileged": False,
        "Init": True,
        "RestartPolicy": {"Name": "no"},
        **resource_limits(config.limits),
    }
    return {
        "Image": image,
        "Entrypoint": list(command),
        "Cmd": [],
        "WorkingDir": "/tmp",
        "Env": [f"{name}={value}" for name, value in sorted(values.items())],
        "Labels": {BENCH_LABEL: config.daemon.host},
        "HostConfig": host_config,
    }


class OneShot:
    """Runs one-shot containers for this daemon's host on `engine`."""

    def __init__(self, config: Config, engine: Engine) -> None:
        self.config = config
        self.engine = engine

    def remove_leftovers(self) -> list[str]:
        """Remove this host's one-shot containers (a bench killed midway); returns their names."""
        found = self.engine.containers({"label": [f"{BENCH_LABEL}={self.config.daemon.host}"]})
        names = []
        for container in found:
            name = str(container.get("Name") or container["Id"]).lstrip("/")
            self.engine.remove_container(container["Id"], LOG_KEY)
            names.append(name)
        return names

    def run(
        self,
        image: str,
        command: Sequence[str],
        gpus: Sequence[int] = (),
        mounts: Sequence[tuple[Path, PurePosixPath]] = (),
        environment: Mapping[str, str] | None = None,
        timeout: float = 600.0,
    ) -> OneShotResult:
        """Run `command` in a new container of `image` with `gpus`; wait for it; remove it.

        Returns its exit code and output (a non-zero exit is returned, not
        raised). Raises `OneShotTimeout` when it runs longer than `timeout`
        seconds, `SessionError` when the engine refuses the container (an
        image that is missing, GPUs the host's mode cannot give), and
        `RuntimeUnavailable` when the engine does not answer. The container
        is removed in every case.
        """
        gpu = host_gpu_access(self.config.host(), gpus)
        payload = oneshot_payload(self.config, image, command, gpu, mounts, environment)
        name = f"gpuresa-bench-{self.config.daemon.host}-{secrets.token_hex(4)}"
        container = self.engine.create_container(name, payload, LOG_KEY)
        try:
            started = time.monotonic()
            self.engine.start_container(container, LOG_KEY)
            deadline = started + timeout
            while True:
                attributes = self.engine.inspect(container, LOG_KEY) or {}
                state = attributes.get("State", {})
                if state.get("Status") in ("exited", "dead") or not attributes:
                    break
                if time.monotonic() > deadline:
                    raise OneShotTimeout(
                        f"{' '.join(command)} did not finish within {timeout:.0f} s in {image}"
                    )
                time.sleep(POLL_INTERVAL)
            seconds = time.monotonic() - started
            stdout, stderr = self.engine.output(container, LOG_KEY)
            return OneShotResult(int(state.get("ExitCode", -1)), stdout, stderr, seconds)
        finally:
            self.engine.remove_container(container, LOG_KEY)
