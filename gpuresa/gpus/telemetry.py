"""The one gateway to the GPUs: NVML (`nvidia-ml-py`), else `nvidia-smi -q -x`.

Nothing else in gpuresa talks to NVML or runs nvidia-smi for telemetry; every
other part takes the `GpuSnapshot` this module returns. Both backends are
injected at this boundary: `nvml` is any object with pynvml's functions (the
tests replay answers recorded on a real H100), `run_smi` any callable that
returns `nvidia-smi -q -x`'s output.

NVML answers in about 0.5 ms per GPU (measured on an H100: five calls);
nvidia-smi takes about 100 ms per call, so it is only the fallback for hosts
where the NVML library cannot be loaded.
"""

from __future__ import annotations

import logging
import re
import subprocess
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from gpuresa.gpus.readings import GpuProcess, GpuReading, GpuSnapshot

log = logging.getLogger(__name__)

Source = Literal["auto", "nvml", "nvidia-smi", "none"]
SmiRunner = Callable[[], str]

SMI_COMMAND = ("nvidia-smi", "-q", "-x")
SMI_TIMEOUT_SECONDS = 20
_MIB = 1024 * 1024
_UNIT_BYTES = {"b": 1, "kib": 1024, "mib": _MIB, "gib": 1024 * _MIB}


class TelemetryError(Exception):
    """A backend could not read the GPUs; the message says which and why."""


def run_nvidia_smi() -> str:
    """`nvidia-smi -q -x`'s output. Raises `TelemetryError` when it is absent or fails."""
    try:
        result = subprocess.run(
            SMI_COMMAND, capture_output=True, text=True, timeout=SMI_TIMEOUT_SECONDS, check=False
        )
    except FileNotFoundError:
        raise TelemetryError("nvidia-smi is not installed") from None
    except subprocess.TimeoutExpired:
        raise TelemetryError(f"nvidia-smi did not answer within {SMI_TIMEOUT_SECONDS} s") from None
    if result.returncode != 0:
        detail = (result.stdout + result.stderr).strip().splitlines()
        raise TelemetryError(f"nvidia-smi failed: {detail[-1] if detail else result.returncode}")
    return result.stdout


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """Reads the GPUs through NVML; `nvml` is the pynvml module or a stand-in with its API."""

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        self.initialised = False
        self.driver_version: str | None = None

    def _init(self) -> None:
        if self.initialised:
            return
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as error:
            raise TelemetryError(f"NVML cannot start: {error}") from None
        except OSError as error:
            raise TelemetryError(f"NVML library cannot be loaded: {error}") from None
        self.initialised = True
        try:
            self.driver_version = _text(self.nvml.nvmlSystemGetDriverVersion())
        except self.nvml.NVMLError:
            self.driver_version = None

    def close(self) -> None:
        if self.initialised:
            self.initialised = False
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as error:
                log.debug("NVML shutdown: %s", error)

    def read(self) -> tuple[GpuReading, ...]:
        """Every GPU NVML can reach; a GPU that fails its identity calls is left out.

        Raises `TelemetryError` when NVML cannot start or count the GPUs.
        """
        self._init()
        nvml = self.nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as error:
            # the driver went away under us: start NVML again next time
            self.close()
            raise TelemetryError(f"NVML cannot count the GPUs: {error}") from None
        readings = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                name = _text(nvml.nvmlDeviceGetName(handle))
            except nvml.NVMLError as error:
                # a GPU that fell off the bus ("GPU is lost") answers nothing useful
                log.warning("GPU %s does not answer NVML: %s", index, error)
                continue
            readings.append(self._reading(index, handle, uuid, name))
        return tuple(readings)

    def _reading(self, index: int, handle: Any, uuid: str, name: str) -> GpuReading:
        nvml = self.nvml

        def ask(function: str) -> Any:
            try:
                return getattr(nvml, function)(handle)
            except nvml.NVMLError as error:
                log.debug("GPU %s: %s: %s", index, function, error)
                return None

        rates = ask("nvmlDeviceGetUtilizationRates")
        memory = ask("nvmlDeviceGetMemoryInfo")
        minor = ask("nvmlDeviceGetMinorNumber")
        processes: dict[int, GpuProcess] = {}
        for function in ("nvmlDeviceGetComputeRunningProcesses",
                         "nvmlDeviceGetGraphicsRunningProcesses"):  # fmt: skip
            for process in ask(function) or ():
                used = getattr(process, "usedGpuMemory", None)
                processes[int(process.pid)] = GpuProcess(
                    int(process.pid), int(used) if used is not None else None
                )
        return GpuReading(
            index=index,
            uuid=uuid,
            name=name,
            minor=int(minor) if minor is not None else None,
            utilization=int(rates.gpu) if rates is not None else None,
            memory_utilization=int(rates.memory) if rates is not None else None,
            memory_used=int(memory.used) if memory is not None else None,
            memory_total=int(memory.total) if memory is not None else None,
            processes=tuple(processes[pid] for pid in sorted(processes)),
        )


def _number(text: str | None) -> int | None:
    """ "98 %" -> 98, "N/A" or nothing -> None."""
    if text is None:
        return None
    match = re.match(r"\s*(\d+)", text)
    return int(match.group(1)) if match else None


def _bytes(text: str | None) -> int | None:
    """ "1642 MiB" -> bytes, "N/A" or nothing -> None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?i?B)\s*", text, re.IGNORECASE)
    if not match:
        return None
    return int(match.group(1)) * _UNIT_BYTES.get(match.group(2).lower(), _MIB)


def parse_smi_xml(text: str) -> tuple[tuple[GpuReading, ...], str | None]:
    """The GPUs and driver version in `nvidia-smi -q -x` output.

    nvidia-smi lists GPUs in NVML index order and does not print the index, so
    the position is the index. Raises `TelemetryError` on output that is not
    nvidia-smi's XML.
    """
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        raise TelemetryError(f"nvidia-smi printed no readable XML: {error}") from None
    if root.tag != "nvidia_smi_log":
        raise TelemetryError(f"nvidia-smi printed <{root.tag}>, not <nvidia_smi_log>")
    readings = []
    for index, gpu in enumerate(root.findall("gpu")):
        processes = tuple(
            GpuProcess(pid, _bytes(process.findtext("used_memory")))
            for process in gpu.findall("processes/process_info")
            if (pid := _number(process.findtext("pid"))) is not None
        )
        readings.append(
            GpuReading(
                index=index,
                uuid=(gpu.findtext("uuid") or "").strip(),
                name=(gpu.findtext("product_name") or "").strip(),
                minor=_number(gpu.findtext("minor_number")),
                utilization=_number(gpu.findtext("utilization/gpu_util")),
                memory_utilization=_number(gpu.findtext("utilization/memory_util")),
                memory_used=_bytes(gpu.findtext("fb_memory_usage/used")),
                memory_total=_bytes(gpu.findtext("fb_memory_usage/total")),
                processes=tuple(sorted(processes, key=lambda process: process.pid)),
            )
        )
    return tuple(readings), (root.findtext("driver_version") or "").strip() or None


class Telemetry:
    """Samples the host's GPUs: NVML first, nvidia-smi where NVML cannot be loaded.

    source: "auto" (NVML, else nvidia-smi), "nvml", "nvidia-smi", or "none"
    (a host without GPUs: every snapshot is empty and ok). Used from one
    thread at a time (the daemon's telemetry worker).
    """

    def __init__(
        self, source: Source = "auto", nvml: Any = None, run_smi: SmiRunner | None = None
    ) -> None:
        self.source = source
        self._nvml_module = nvml
        self._nvml: NvmlBackend | None = None
        self._run_smi = run_smi or run_nvidia_smi
        self._last_problem: str | None = None

    def _nvml_backend(self) -> NvmlBackend:
        if self._nvml is None:
            try:
                self._nvml = NvmlBackend(self._nvml_module)
            except ImportError as error:
                raise TelemetryError(f"nvidia-ml-py is not installed: {error}") from None
        return self._nvml

    def sample(self, now: datetime) -> GpuSnapshot:
        """What every GPU says now; never raises for a missing driver or tool.

        A snapshot whose `error` is set means no backend answered (the reason of
        each is in it); it is logged once per change of reason.
        """
        if self.source == "none":
            return GpuSnapshot(now, "none")
        problems = []
        if self.source in ("auto", "nvml"):
            try:
                backend = self._nvml_backend()
                gpus = backend.read()
                self._recovered()
                return GpuSnapshot(now, "nvml", gpus, driver_version=backend.driver_version)
            except TelemetryError as error:
                problems.append(str(error))
        if self.source in ("auto", "nvidia-smi"):
            try:
                gpus, driver = parse_smi_xml(self._run_smi())
                self._recovered()
                return GpuSnapshot(now, "nvidia-smi", gpus, driver_version=driver)
            except TelemetryError as error:
                problems.append(str(error))
        problem = "; ".join(problems)
        if problem != self._last_problem:
            log.warning("cannot read the GPUs: %s", problem)
            self._last_problem = problem
        return GpuSnapshot(now, "none", error=problem)

    def _recovered(self) -> None:
        if self._last_problem is not None:
            log.info("GPUs readable again")
            self._last_problem = None

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
