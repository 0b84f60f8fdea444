"""What a session's container needs of the host for its booked GPUs, whatever runs it.

One description (`GpuAccess`) for every backend that starts a container: the
engines put it in their create payload, udocker turns it into its own options.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gpuresa.config.sections import HostConfig
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import format_gpus

# where the host's driver files appear in devices mode (CUDA images already
# list these folders in LD_LIBRARY_PATH and PATH; the entrypoint adds them otherwise)
DRIVER_LIBRARY_TARGET = PurePosixPath("/usr/local/nvidia/lib64")
DRIVER_BINARY_TARGET = PurePosixPath("/usr/local/nvidia/bin")


@dataclass(frozen=True)
class GpuAccess:
    """What a GPU mode adds to the main container's create payload."""

    device_requests: list[dict[str, Any]] = field(default_factory=list)
    devices: list[dict[str, str]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)


def gpu_access(
    host: HostConfig,
    gpus: Sequence[int],
    existing_devices: Collection[str] = (),
    driver_libraries: Sequence[Path] = (),
    driver_binaries: Sequence[Path] = (),
) -> GpuAccess:
    """The Docker settings that give a container exactly the GPUs `gpus` of `host`.

    - nvidia: one device request with explicit ids (never a count: a count hands
      every session the same GPUs);
    - cdi: CDI names `nvidia.com/gpu=<index>`;
    - devices: `/dev/nvidia<N>`, `/dev/nvidiactl` and every `/dev/nvidia-uvm*`
      in `existing_devices`, at the same paths (Docker bind-mounts device nodes
      under user namespaces), plus the driver files read-only;
    - none: nothing, and any GPU request is refused.

    NVIDIA_VISIBLE_DEVICES always names the booked GPUs ("void" for none), so a
    host whose default runtime is nvidia cannot hand out every GPU through an
    image's `NVIDIA_VISIBLE_DEVICES=all`. Raises `SessionError` for a request the
    mode cannot serve.
    """
    gpus = tuple(gpus)
    host_indices = format_gpus(gpus)
    environment = {"NVIDIA_VISIBLE_DEVICES": host_indices or "void"}
    if host.gpu_mode == "none":
        if gpus:
            raise SessionError(f"host {host.name} has gpu_mode 'none' and cannot give GPUs {gpus}")
        return GpuAccess(environment=environment)
    if not gpus:
        return GpuAccess(environment=environment)
    if host.gpu_mode in ("nvidia", "cdi"):
        # the toolkit shows only the booked GPUs, numbered from 0 inside
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(str(number) for number in range(len(gpus)))
        environment["NVIDIA_DRIVER_CAPABILITIES"] = "compute,utility"
        if host.gpu_mode == "nvidia":
            request = {
                "Driver": "nvidia",
                "Count": 0,
                "DeviceIDs": [str(index) for index in gpus],
                "Capabilities": [["gpu"]],
                "Options": {},
            }
        else:
            request = {
                "Driver": "cdi",
                "Count": 0,
                "DeviceIDs": [f"nvidia.com/gpu={index}" for index in gpus],
                "Capabilities": [],
                "Options": {},
            }
        return GpuAccess(device_requests=[request], environment=environment)
    # devices: without a toolkit the driver enumerates every GPU of the host,
    # so CUDA must be told the host indices of the booked ones
    environment["CUDA_VISIBLE_DEVICES"] = host_indices
    wanted = [f"/dev/nvidia{index}" for index in gpus]
    missing = [path for path in [*wanted, "/dev/nvidiactl"] if path not in existing_devices]
    if missing:
        raise SessionError(
            f"host {host.name} (gpu_mode 'devices') has no {', '.join(missing)}: "
            "is the NVIDIA driver loaded?"
        )
    shared = sorted(path for path in existing_devices if path.startswith("/dev/nvidia-uvm"))
    devices = [
        {"PathOnHost": path, "PathInContainer": path, "CgroupPermissions": "rwm"}
        for path in [*wanted, "/dev/nvidiactl", *shared]
    ]
    mounts = [
        _bind(library, DRIVER_LIBRARY_TARGET / library.name, read_only=True)
        for library in driver_libraries
    ] + [
        _bind(binary, DRIVER_BINARY_TARGET / binary.name, read_only=True)
        for binary in driver_binaries
    ]
    return GpuAccess(devices=devices, mounts=mounts, environment=environment)


def _bind(
    source: Path | PurePosixPath, target: Path | PurePosixPath, *, read_only: bool
) -> dict[str, Any]:
    return {"Type": "bind", "Source": str(source), "Target": str(target), "ReadOnly": read_only}
