"""What `gpuresa bench` runs on each side, and how it reads the measurement.

Pure: command lines, environments and output parsing, no processes started.

The built-in workloads are scripts shipped in `gpuresa/bench/scripts/` (copied
to a folder that the container mounts read-only at `CONTAINER_SCRIPTS`):

- `cpu`: pure-Python integer matrix products (`cpu_matmul.py`), for hosts
  without GPUs; any python3 runs it.
- `pytorch`: ResNet-50 training steps on synthetic images (`resnet50_torch.py`;
  one GPU directly, several with DistributedDataParallel).
- `tensorflow`: the same with `tf.keras.applications.ResNet50` and
  MirroredStrategy (`resnet50_tf.py`).
- `command`: an admin's own shell command, run with `/bin/sh -c` on both
  sides; `GPURESA_BENCH_GPUS` holds the number of GPUs it is given.

The measurement format (what every workload prints, and what `--command`
must print): the last line of the form `result: <number> [unit]` wins; when
there is none, the last number anywhere in the standard output is the
measurement (with the unit "units"). A larger number means faster: the
ratio is container/host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpuresa.errors import UserError

SCRIPTS = Path(__file__).parent / "scripts"
# where the container sees the scripts (a read-only bind mount)
CONTAINER_SCRIPTS = PurePosixPath("/opt/gpuresa-bench")
# the Python of the session images (every upstream image has a python3)
CONTAINER_PYTHON = "python3"
# exit codes of the framework workloads (see their docstrings)
MISSING_FRAMEWORK = 3
TOO_FEW_GPUS = 4

FRAMEWORKS = {"pytorch": "PyTorch", "tensorflow": "TensorFlow"}
WORKLOAD_NAMES = ("auto", "cpu", "pytorch", "tensorflow")


@dataclass(frozen=True)
class Workload:
    """One workload: a shipped script with its arguments, or an admin's shell command."""

    name: str
    script: str | None = None
    arguments: tuple[str, ...] = ()
    shell: str | None = None
    unit: str = "units"

    @property
    def uses_gpus(self) -> bool:
        return self.name in FRAMEWORKS

    def describe(self) -> str:
        if self.shell is not None:
            return f"command {self.shell!r}"
        if self.name == "cpu":
            return "cpu (pure-Python matrix products)"
        return f"{self.name} (ResNet-50 training, synthetic images)"

    def argv(self, scripts: PurePosixPath | Path, python: str, gpu_count: int) -> list[str]:
        """The command line of one run with `gpu_count` GPUs.

        `scripts` is where this side sees the shipped scripts and `python` its
        interpreter; a shell command ignores both.
        """
        if self.shell is not None:
            return ["/bin/sh", "-c", self.shell]
        assert self.script is not None
        return [python, str(scripts / self.script), "--gpus", str(gpu_count), *self.arguments]

    def check_argv(self, scripts: PurePosixPath | Path, python: str) -> list[str] | None:
        """A quick command that tells whether `python` has the framework, or None (no need)."""
        if not self.uses_gpus:
            return None
        assert self.script is not None
        return [python, str(scripts / self.script), "--check", "--gpus", "0"]


def builtin(name: str, arguments: Sequence[str] = ()) -> Workload:
    """The shipped workload `name` ("cpu", "pytorch" or "tensorflow")."""
    if name == "cpu":
        return Workload("cpu", "cpu_matmul.py", tuple(arguments), unit="matmul/s")
    if name == "pytorch":
        return Workload("pytorch", "resnet50_torch.py", tuple(arguments), unit="images/s")
    if name == "tensorflow":
        return Workload("tensorflow", "resnet50_tf.py", tuple(arguments), unit="images/s")
    raise UserError(f"unknown workload {name!r}: choose among {', '.join(WORKLOAD_NAMES)}")


def shell_command(text: str) -> Workload:
    """An admin's `--command`, run with /bin/sh -c on both sides."""
    if not text.strip():
        raise UserError("--command: give a command line, such as 'python3 train.py'")
    return Workload("command", shell=text)


def framework_of(template: str) -> str:
    """The framework a template's images carry, judged by its name.

    "pytorch" for names with "torch", "tensorflow" for names with
    "tensorflow" or "digits" (NVIDIA's DIGITS images carry TensorFlow);
    raises `UserError` for another name (then `--workload` says which).
    """
    name = template.lower()
    if "torch" in name:
        return "pytorch"
    if "tensorflow" in name or "digits" in name:
        return "tensorflow"
    raise UserError(
        f"cannot tell which framework template {template!r} has: "
        "say --workload pytorch or --workload tensorflow (or give --command)"
    )


def gpu_counts(gpus: Sequence[int]) -> list[int]:
    """The GPU counts to measure: 1, 2 and all of `gpus` (each once, in order); [0] for none."""
    if not gpus:
        return [0]
    return sorted({count for count in (1, 2, len(gpus)) if count <= len(gpus)})


def host_environment(base: Mapping[str, str], gpus: Sequence[int]) -> dict[str, str]:
    """The environment of a host run on the host GPUs `gpus` (their nvidia-smi indices).

    CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which
    makes its numbers nvidia-smi's (and gpuresa's); CUDA_VISIBLE_DEVICES then
    shows the process exactly the GPUs the container gets (none: empty).
    GPURESA_BENCH_GPUS is their number, on both sides.
    """
    return {
        **base,
        "GPURESA_BENCH_GPUS": str(len(gpus)),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in gpus),
    }


@dataclass(frozen=True)
class Measurement:
    value: float
    unit: str


_RESULT = re.compile(
    r"^[ \t]*result:[ \t]*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[ \t]*(\S.*?)?[ \t]*$",
    re.MULTILINE,
)
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_measurement(output: str, default_unit: str = "units") -> Measurement | None:
    """The measurement in a run's standard output, or None when it has no number.

    The last `result: <number> [unit]` line wins; without one, the last
    number anywhere in `output`, in `default_unit`.
    """
    results = list(_RESULT.finditer(output))
    if results:
        last = results[-1]
        return Measurement(float(last.group(1)), last.group(2) or default_unit)
    numbers = _NUMBER.findall(output)
    if not numbers:
        return None
    return Measurement(float(numbers[-1]), default_unit)


def info_lines(output: str) -> list[str]:
    """The `framework:`, `model:` and `workload:` lines a workload printed, for the report."""
    return [
        line.strip()
        for line in output.splitlines()
        if re.match(r"\s*(framework|model|workload|checksum):", line)
    ]
