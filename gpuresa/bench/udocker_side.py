"""The container side of a bench on a udocker host: the template's image, run by a login.

udocker sessions run as their login's own account, so the bench does too
(`gpuresa bench --user LOGIN`): the image is loaded into that login's
repository as a session's would be, one container is made from it for the
whole bench and removed after, and each run is a `udocker run` of that
container in runc mode, with the GPUs given as a session gets them (device
nodes, driver files, `CUDA_VISIBLE_DEVICES`). The host side runs as the same
login, so both sides differ only by the container.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from gpuresa.access import Account
from gpuresa.backends.udocker import tools
from gpuresa.backends.udocker.backend import UdockerBackend
from gpuresa.backends.udocker.devices import driver_volumes
from gpuresa.backends.udocker.images import make_container
from gpuresa.bench.report import CONTAINER
from gpuresa.bench.runner import BenchFailed, RunOutput
from gpuresa.bench.workloads import CONTAINER_PYTHON, CONTAINER_SCRIPTS, Workload
from gpuresa.gpus.devices import host_gpu_access


class UdockerSide:
    """Runs workloads in one udocker container of the template's image, as `account`."""

    name = CONTAINER

    def __init__(
        self, backend: UdockerBackend, account: Account, scripts: Path, timeout: float
    ) -> None:
        self.backend = backend
        self.config = backend.config
        self.account = account
        self.scripts = scripts
        self.timeout = timeout
        self.container = f"gpuresa-bench-{secrets.token_hex(4)}"

    def make(self, template: str, cuda: str | None) -> str:
        """Load the template's image for the login and make the bench's container; the
        image's name."""
        key = "bench"
        image = self.backend.images.load(key, self.account, template, cuda)
        make_container(self.config, self.account, image, self.container, key)
        return image

    def remove(self) -> None:
        tools.remove_detached(self.config, self.account, self.container, "bench")

    def command(self, workload: Workload, gpu_count: int) -> list[str]:
        return workload.argv(CONTAINER_SCRIPTS, CONTAINER_PYTHON, gpu_count)

    def run(self, command: Sequence[str], gpus: tuple[int, ...]) -> RunOutput:
        gpu = host_gpu_access(self.config.host(), gpus)
        values = {**gpu.environment, "GPURESA_BENCH_GPUS": str(len(gpus)),
                  "PYTHONUNBUFFERED": "1"}  # fmt: skip
        arguments = ["run", "--nobanner", f"--volume={self.scripts}:{CONTAINER_SCRIPTS}"]
        arguments += [f"--device={device['PathOnHost']}" for device in gpu.devices]
        arguments += [f"--volume={source}:{target}" for source, target, _ in
                      driver_volumes(self.backend.root, gpu.mounts)]  # fmt: skip
        arguments += [f"--env={name}={value}" for name, value in sorted(values.items())]
        # the workload itself, not the image's entrypoint (a session's, which needs its files)
        arguments += [f"--entrypoint={command[0]}", self.container, *command[1:]]
        started = time.monotonic()
        try:
            result = subprocess.run(
                tools.as_user(self.account, tools.udocker_command(self.config, arguments)),
                env=tools.environment(self.config, self.account),
                # the login can change the container: never the admin's terminal as its input
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self.timeout,
                cwd="/",
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BenchFailed(
                f"{' '.join(command)} did not finish within {self.timeout:.0f} s in udocker"
            ) from None
        return RunOutput(result.returncode, result.stdout, result.stderr,
                         time.monotonic() - started)  # fmt: skip
