"""The demo's GPUs: what `nvidia-smi -L` lists, given to the demo's sessions.

On a GPU host the demo books one GPU, as a new site would; without NVIDIA's
driver the demo host has none, and its session runs without one.
"""

from __future__ import annotations

import subprocess
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class DemoGpus:
    """The demo host's GPUs: how many, and how they reach containers."""

    count: int
    mode: str = "none"
    libraries: tuple[str, ...] = ()

    def toml(self) -> str:
        """The [[hosts]] lines that give them."""
        if not self.count:
            return 'gpus = []\ngpu_mode = "none"'
        lines = f'gpus = "auto"\ngpu_mode = "{self.mode}"'
        if self.libraries:
            lines += (
                "\ndriver_libraries = [" + ", ".join(f'"{lib}"' for lib in self.libraries) + "]"
            )
        return lines

    def summary(self) -> str:
        if not self.count:
            return "no GPU on this machine: the session runs without one"
        return f"{self.count} GPU(s) here ({self.mode} mode): the booking takes one"


NO_GPUS = DemoGpus(0)

# the driver files a session needs without NVIDIA's toolkit (what `singularity --nv` binds)
DRIVER_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so*",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so*",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so*",
)


def choose_gpus(gpu_lines: list[str], runtimes: Collection[str]) -> DemoGpus:
    """The demo's GPUs from `nvidia-smi -L`'s lines and the Docker engine's runtimes (pure).

    NVIDIA's Container Toolkit (an "nvidia" runtime) gives GPUs by device request;
    without it, the device nodes and the driver's libraries are bind-mounted.
    """
    count = sum(1 for line in gpu_lines if line.startswith("GPU "))
    if not count:
        return NO_GPUS
    if "nvidia" in runtimes:
        return DemoGpus(count, "nvidia")
    return DemoGpus(count, "devices", DRIVER_LIBRARIES)


def detect_gpus(runtimes: Collection[str]) -> DemoGpus:
    """This machine's GPUs, as `nvidia-smi -L` lists them (none without the driver)."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return NO_GPUS
    return choose_gpus(listing.splitlines(), runtimes)
