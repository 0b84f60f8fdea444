"""Running a bench: the same workload on the host and in a container, interleaved.

`run_bench` decides the order (for each GPU count: host, container, host,
container, …, so a slow drift of the machine touches both sides alike) and
reads each run's measurement; the two sides that actually start processes
(`HostSide`, a subprocess; `ContainerSide`, a one-shot container) are given
to it, so it can be driven with recorded outputs as well.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from gpuresa.backends.engines.oneshot import OneShot
from gpuresa.bench.report import CONTAINER, HOST, Sample
from gpuresa.bench.workloads import (
    CONTAINER_PYTHON,
    CONTAINER_SCRIPTS,
    FRAMEWORKS,
    MISSING_FRAMEWORK,
    TOO_FEW_GPUS,
    Workload,
    host_environment,
    info_lines,
    parse_measurement,
)
from gpuresa.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOutput:
    """How one run ended."""

    exit_code: int
    stdout: str
    stderr: str
    seconds: float


class Side(Protocol):
    """Where a workload runs: `name` is "host" or "container"."""

    name: str

    def command(self, workload: Workload, gpu_count: int) -> list[str]: ...

    def run(self, command: Sequence[str], gpus: tuple[int, ...]) -> RunOutput: ...


class BenchFailed(UserError):
    """A run failed or printed no measurement; the message quotes its output."""


class HostSide:
    """Runs workloads as subprocesses on the host, the shipped scripts with `python`."""

    name = HOST

    def __init__(
        self, scripts: Path, python: str, timeout: float, prefix: Sequence[str] = ()
    ) -> None:
        self.scripts = scripts
        self.python = python
        self.timeout = timeout
        # what each run is started through (`setpriv …`: as the login of a udocker bench)
        self.prefix = list(prefix)

    def command(self, workload: Workload, gpu_count: int) -> list[str]:
        return workload.argv(self.scripts, self.python, gpu_count)

    def run(self, command: Sequence[str], gpus: tuple[int, ...]) -> RunOutput:
        started = time.monotonic()
        try:
            result = subprocess.run(
                [*self.prefix, *command],
                capture_output=True,
                text=True,
                errors="replace",
                env=host_environment(os.environ, gpus),
                timeout=self.timeout,
                check=False,
            )
        except FileNotFoundError:
            raise BenchFailed(
                f"{command[0]}: no such program on this host (give another with --host-python)"
            ) from None
        except subprocess.TimeoutExpired:
            raise BenchFailed(
                f"{' '.join(command)} did not finish within {self.timeout:.0f} s on the host"
            ) from None
        return RunOutput(
            result.returncode, result.stdout, result.stderr, time.monotonic() - started
        )


class ContainerSide:
    """Runs workloads in one-shot containers of `image` (see `runtime.oneshot`)."""

    name = CONTAINER

    def __init__(self, oneshot: OneShot, image: str, scripts: Path, timeout: float) -> None:
        self.oneshot = oneshot
        self.image = image
        self.scripts = scripts
        self.timeout = timeout

    def command(self, workload: Workload, gpu_count: int) -> list[str]:
        return workload.argv(CONTAINER_SCRIPTS, CONTAINER_PYTHON, gpu_count)

    def run(self, command: Sequence[str], gpus: tuple[int, ...]) -> RunOutput:
        result = self.oneshot.run(
            self.image,
            command,
            gpus,
            mounts=[(self.scripts, PurePosixPath(CONTAINER_SCRIPTS))],
            environment={"GPURESA_BENCH_GPUS": str(len(gpus)), "PYTHONUNBUFFERED": "1"},
            timeout=self.timeout,
        )
        return RunOutput(result.exit_code, result.stdout, result.stderr, result.seconds)


def check_framework(side: Side, workload: Workload, check: Sequence[str] | None) -> str:
    """Run a workload's `--check` command on `side`; returns its framework line.

    Raises `BenchFailed` with what to install when the framework is missing.
    Returns "" when there is nothing to check.
    """
    if check is None:
        return ""
    output = side.run(check, ())
    _refuse_failure(side.name, workload, check, output)
    lines = info_lines(output.stdout)
    return lines[0] if lines else ""


def _refuse_failure(
    side: str, workload: Workload, command: Sequence[str], output: RunOutput
) -> None:
    if output.exit_code == 0:
        return
    where = "the host" if side == HOST else "the container"
    if workload.uses_gpus and output.exit_code == MISSING_FRAMEWORK:
        framework = FRAMEWORKS[workload.name]
        advice = (
            "install it for that Python (for GPUs, the build matching the driver), "
            "give another with --host-python, or measure your own --command"
            if side == HOST
            else "choose a template whose image has it (--template), or --workload"
        )
        raise BenchFailed(f"{where}'s Python has no {framework} ({command[0]}): {advice}")
    if workload.uses_gpus and output.exit_code == TOO_FEW_GPUS:
        raise BenchFailed(f"{where} sees fewer GPUs than given: {_tail(output.stderr)}")
    raise BenchFailed(
        f"{' '.join(command)} failed on {where} (exit code {output.exit_code}):\n"
        f"{_tail(output.stderr + output.stdout)}"
    )


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"


def run_bench(
    workload: Workload,
    gpus: Sequence[int],
    counts: Sequence[int],
    runs: int,
    sides: Sequence[Side],
    progress: Callable[[Sample], None] = lambda sample: None,
) -> tuple[list[Sample], list[str]]:
    """Run `workload` `runs` times on each side for each GPU count, interleaved.

    For each count N the first N of `gpus` are used: side 1, side 2, side 1,
    … Returns the samples (in the order they ran) and the lines that say
    what ran (framework, model, checksum), prefixed by their side. Raises
    `BenchFailed` when a run fails, prints no measurement, or (CPU workload)
    did other work than the first run (its checksum differs).
    """
    samples: list[Sample] = []
    info: dict[str, None] = {}
    checksums: set[str] = set()
    for count in counts:
        chosen = tuple(gpus[:count])
        for index in range(runs):
            for side in sides:
                command = side.command(workload, count)
                log.debug(
                    "bench: %s run %d with GPUs %s: %s", side.name, index + 1, chosen, command
                )
                output = side.run(command, chosen)
                _refuse_failure(side.name, workload, command, output)
                measurement = parse_measurement(output.stdout, workload.unit)
                if measurement is None:
                    raise BenchFailed(
                        f"{' '.join(command)} printed no measurement on the {side.name} "
                        "(expected a line 'result: <number> <unit>' or at least a number):\n"
                        f"{_tail(output.stdout + output.stderr)}"
                    )
                for line in info_lines(output.stdout):
                    if line.startswith("checksum:"):
                        checksums.add(line)
                    else:
                        info.setdefault(f"{side.name}: {line}")
                if len(checksums) > 1:
                    raise BenchFailed(
                        f"the runs did different work (checksums {sorted(checksums)}): "
                        "the host and the container do not compute the same thing"
                    )
                sample = Sample(
                    side.name, chosen, measurement.value, measurement.unit, output.seconds, index
                )
                samples.append(sample)
                progress(sample)
    return samples, list(info)
