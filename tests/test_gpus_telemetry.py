"""The telemetry gateway against answers recorded on a real H100 (NVML and nvidia-smi XML)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pynvml
import pytest
from nvml_replay import CORPUS, RecordedNvml

from gpuresa.gpus.readings import GpuProcess
from gpuresa.gpus.telemetry import Telemetry, TelemetryError, parse_smi_xml

NOW = datetime(2026, 11, 22, 20, 20, tzinfo=UTC)
MIB = 1024 * 1024


def smi(name: str) -> str:
    return (CORPUS / f"nvidia-smi-{name}.xml").read_text()


def test_nvml_busy_gpu_shows_its_use_and_the_process() -> None:
    snapshot = Telemetry("nvml", nvml=RecordedNvml("busy")).sample(NOW)
    assert snapshot.ok and snapshot.source == "nvml"
    assert snapshot.driver_version == "580.159.04"
    (gpu,) = snapshot.gpus
    assert gpu.index == 0 and gpu.minor == 0
    assert gpu.uuid == "GPU-3297c787-9187-1a54-e191-b20dfec89ad6"
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.utilization is not None and gpu.utilization >= 90
    assert gpu.memory_total == 85520809984
    assert gpu.memory_used is not None and gpu.memory_used > 1000 * MIB
    assert gpu.processes == (GpuProcess(447, 1721761792),)
    assert snapshot.by_uuid(gpu.uuid) is gpu and snapshot.by_index(0) is gpu


def test_nvml_idle_gpu_has_no_process_and_no_use() -> None:
    (gpu,) = Telemetry("nvml", nvml=RecordedNvml("idle")).sample(NOW).gpus
    assert gpu.utilization == 0 and gpu.processes == ()


def test_smi_xml_gives_the_same_picture_as_nvml() -> None:
    nvml = Telemetry("nvml", nvml=RecordedNvml("busy")).sample(NOW).gpus[0]
    gpus, driver = parse_smi_xml(smi("busy"))
    (gpu,) = gpus
    assert driver == "580.159.04"
    assert (gpu.index, gpu.uuid, gpu.name, gpu.minor) == (0, nvml.uuid, nvml.name, 0)
    assert gpu.utilization is not None and gpu.utilization >= 90
    assert gpu.memory_total == 81559 * MIB
    assert gpu.processes == (GpuProcess(447, 1642 * MIB),)
    idle, _ = parse_smi_xml(smi("idle"))
    assert idle[0].processes == () and idle[0].utilization == 0


def test_auto_falls_back_to_nvidia_smi_when_nvml_cannot_start() -> None:
    nvml = RecordedNvml("busy", fail_init=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    snapshot = Telemetry("auto", nvml=nvml, run_smi=lambda: smi("busy")).sample(NOW)
    assert snapshot.ok and snapshot.source == "nvidia-smi"
    assert snapshot.gpus[0].processes[0].pid == 447


def test_nothing_answers_gives_an_error_snapshot_not_an_exception() -> None:
    def broken() -> str:
        raise TelemetryError("nvidia-smi is not installed")

    nvml = RecordedNvml("busy", fail_init=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    snapshot = Telemetry("auto", nvml=nvml, run_smi=broken).sample(NOW)
    assert not snapshot.ok and snapshot.gpus == ()
    assert snapshot.error is not None
    assert "NVML" in snapshot.error and "nvidia-smi is not installed" in snapshot.error


def test_the_real_gateway_runs_nvidia_smi_from_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in nvidia-smi on PATH prints the XML recorded on the H100
    stand_in = tmp_path / "nvidia-smi"
    stand_in.write_text(
        f"#!/bin/sh\n[ \"$*\" = '-q -x' ] || exit 2\ncat '{CORPUS}/nvidia-smi-busy.xml'\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    snapshot = Telemetry("nvidia-smi").sample(NOW)
    assert snapshot.ok and snapshot.source == "nvidia-smi"
    assert snapshot.driver_version == "580.159.04"
    assert snapshot.gpus[0].processes == (GpuProcess(447, 1642 * MIB),)


def test_without_nvidia_smi_the_real_gateway_gives_an_error_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without an NVIDIA driver the real gateway must say so, not raise
    monkeypatch.setenv("PATH", str(tmp_path))
    snapshot = Telemetry("nvidia-smi").sample(NOW)
    assert not snapshot.ok and snapshot.source == "none"
    assert snapshot.error == "nvidia-smi is not installed"


@pytest.mark.parametrize(
    "text", ["", "<html/>", "not xml at all", "<nvidia_smi_log><gpu>"], ids=repr
)
def test_smi_output_that_is_not_nvidia_smi_xml_is_refused(text: str) -> None:
    with pytest.raises(TelemetryError):
        parse_smi_xml(text)


def test_source_none_is_an_empty_healthy_snapshot() -> None:
    snapshot = Telemetry("none").sample(NOW)
    assert snapshot.ok and snapshot.gpus == ()
