"""What the GPUs said at one instant: plain values, no I/O.

The telemetry gateway (`gpuresa.gpus.telemetry`) makes them; everything else
(usage per booking, idle and unbooked findings, metrics, the status page) only
reads them. A GPU is known by its UUID; its index can change after a reboot.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class GpuProcess:
    """A process holding a context on a GPU, as the host sees it (host pid)."""

    pid: int
    # None when the driver does not tell (e.g. without permission)
    used_memory: int | None = None


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one instant.

    utilization: percent of time a kernel ran over the driver's last sample
    period (None when the driver does not say); memory in bytes; minor: N of
    the device node /dev/nvidiaN.
    """

    index: int
    uuid: str
    name: str
    minor: int | None
    utilization: int | None
    memory_utilization: int | None
    memory_used: int | None
    memory_total: int | None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuSnapshot:
    """Every GPU of the host at `taken`, read through `source`.

    source: "nvml", "nvidia-smi", or "none" when neither answered (then `error`
    says why and `gpus` is empty: an empty list of GPUs is *not* proof that a
    GPU disappeared, so callers check `ok` before concluding anything).
    """

    taken: datetime
    source: str
    gpus: tuple[GpuReading, ...] = ()
    error: str | None = None
    driver_version: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def by_uuid(self, uuid: str) -> GpuReading | None:
        return next((gpu for gpu in self.gpus if gpu.uuid == uuid), None)

    def by_index(self, index: int) -> GpuReading | None:
        return next((gpu for gpu in self.gpus if gpu.index == index), None)
