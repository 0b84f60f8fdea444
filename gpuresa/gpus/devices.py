"""The GPUs this host hands out, and what a session needs of /dev and the driver for them."""

from __future__ import annotations

import logging
import re
import subprocess
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuresa.config.sections import HostConfig
from gpuresa.gpus.access import GpuAccess, gpu_access
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

# How long `HostGpus.indices()` trusts what nvidia-smi said.
GPU_LIST_LIFETIME = timedelta(minutes=5)


class HostGpus:
    """The GPU indices of one host: the configured list, or nvidia-smi's (cached a while)."""

    def __init__(self) -> None:
        self._listed: tuple[datetime, tuple[int, ...]] | None = None
        self._lock = threading.Lock()

    def indices(self, host: HostConfig) -> tuple[int, ...]:
        """The GPU indices `host` hands out.

        The configured list, or for "auto" what `nvidia-smi` reports (asked at
        most every few minutes); empty when gpu_mode is "none" or nvidia-smi is
        absent or fails.
        """
        if host.gpu_mode == "none":
            return ()
        if isinstance(host.gpus, tuple):
            return host.gpus
        with self._lock:
            now = datetime.now(UTC)
            if self._listed is not None and now - self._listed[0] < GPU_LIST_LIFETIME:
                return self._listed[1]
            indices = _nvidia_smi(host)
            self._listed = (now, indices)
            return indices


def _nvidia_smi(host: HostConfig) -> tuple[int, ...]:
    command = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True)
        return tuple(int(line) for line in result.stdout.split() if line.strip().isdigit())
    except FileNotFoundError:
        log.warning('host %s: gpus = "auto" but nvidia-smi is not installed', host.name)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        log.warning("host %s: nvidia-smi failed: %s", host.name, error)
    return ()


def host_gpu_access(host: HostConfig, gpus: Sequence[int]) -> GpuAccess:
    """`gpu_access` with what this host's /dev and driver files hold."""
    if host.gpu_mode != "devices" or not gpus:
        return gpu_access(host, gpus)
    devices = {str(path) for path in Path("/dev").glob("nvidia*")}
    libraries = _expand(host.driver_libraries, "driver_libraries")
    binaries = _expand(host.driver_binaries, "driver_binaries")
    return gpu_access(host, gpus, devices, libraries, binaries)


def _expand(paths: Sequence[Path], key: str) -> list[Path]:
    """Config paths with glob patterns expanded; a plain path that is missing is refused."""
    expanded: list[Path] = []
    for path in paths:
        text = str(path)
        if re.search(r"[*?\[]", text):
            matches = sorted(Path("/").glob(text.lstrip("/")))
            if not matches:
                log.warning("hosts.%s: %s matches no file", key, text)
            expanded.extend(matches)
        elif path.exists():
            expanded.append(path)
        else:
            raise SessionError(f"hosts.{key}: {path} does not exist on this host")
    return expanded
