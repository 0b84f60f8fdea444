"""`gpuresa bench` without Docker: command lines, payloads, parsing, statistics, GPU holders.

The GPU path is pinned here by what runs on each side for 1, 2 and all GPUs
and by reading outputs recorded on a real H100 (tests/fixtures/bench/); the
sides that start processes are replaced by replays of recorded outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath

import pytest
from support.configs import config_of

from gpuresa.backends.engines.oneshot import BENCH_LABEL, oneshot_payload
from gpuresa.bench.holders import gpu_holders
from gpuresa.bench.report import CONTAINER, HOST, Comparison, Sample, compare, summary
from gpuresa.bench.runner import BenchFailed, RunOutput, check_framework, run_bench
from gpuresa.bench.workloads import (
    CONTAINER_PYTHON,
    CONTAINER_SCRIPTS,
    SCRIPTS,
    Workload,
    builtin,
    framework_of,
    gpu_counts,
    host_environment,
    parse_measurement,
    shell_command,
)
from gpuresa.cli import build_parser
from gpuresa.commands.bench_commands import choose_gpus, choose_workload
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.gpus.access import gpu_access
from gpuresa.model import Reservation, Session
from gpuresa.planning.facts import Inventory
from gpuresa.sessions.labels import HOST_LABEL, KEY_LABEL

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
NOW = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


def make_config(gpu_mode: str = "nvidia", gpus: Sequence[int] = (0, 1, 2, 3)) -> Config:
    data = {
        "daemon": {"host": "gpu1", "state_dir": "/tmp/gpuresa-bench-test-state"},
        "hosts": [{"name": "gpu1", "gpus": list(gpus), "gpu_mode": gpu_mode}],
        "limits": {"shm_size": "1g", "pids": 1024, "cpus": 8, "memory": "64g"},
    }
    return config_of(data)


# --- the measurement format ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "value", "unit"),
    [
        ("result: 1234.5 images/s\n", 1234.5, "images/s"),
        ("warm-up 10 steps\nresult: 12 img/s\ndone in 3.5 s\n", 12.0, "img/s"),
        ("result: 1 a/s\nresult: 2 b/s\n", 2.0, "b/s"),  # the last result line wins
        ("  result:\t7e2 widgets  \n", 700.0, "widgets"),
        ("result: 42\n", 42.0, "units"),  # no unit: the default
        ("epoch 3: 812.7 images/sec\n", 812.7, "units"),  # no result line: the last number
        ("took 3 s, 1.5e3 samples per second", 1500.0, "units"),
        ("throughput .5\n", 0.5, "units"),
    ],
)
def test_measurement_is_the_last_result_line_else_the_last_number(
    output: str, value: float, unit: str
) -> None:
    measurement = parse_measurement(output)
    assert measurement is not None
    assert (measurement.value, measurement.unit) == (value, unit)


@pytest.mark.parametrize("output", ["", "no numbers here\n", "result: many\n"])
def test_output_without_a_number_has_no_measurement(output: str) -> None:
    assert parse_measurement(output) is None


def test_a_result_word_inside_a_line_is_not_a_result_line() -> None:
    measurement = parse_measurement("the result: 5 is wrong, 9 is right\n")
    assert measurement is not None and measurement.value == 9.0


@pytest.mark.parametrize(
    ("fixture", "images"),
    [
        ("h100-pytorch-1gpu-fp32-1.out", 2248.14),
        ("h100-pytorch-1gpu-fp32-2.out", 2262.93),
        ("h100-pytorch-1gpu-fp32-3.out", 2210.49),
        ("h100-pytorch-1gpu-amp.out", 2999.52),
        ("h100-pytorch-1gpu-ddp.out", 2164.65),
    ],
)
def test_recorded_h100_outputs_give_images_per_second(fixture: str, images: float) -> None:
    measurement = parse_measurement((FIXTURES / fixture).read_text(), "units")
    assert measurement is not None
    assert (measurement.value, measurement.unit) == (images, "images/s")


def test_a_check_output_has_no_result_line() -> None:
    """`--check` prints only the framework line: its numbers are versions, not results."""
    text = (FIXTURES / "h100-pytorch-check.out").read_text()
    assert "result:" not in text
    assert text.startswith("framework: torch ")


# --- what runs on each side ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "counts"),
    [((), [0]), ((0,), [1]), ((0, 1), [1, 2]), ((0, 1, 2), [1, 2, 3]), ((4, 5, 6, 7), [1, 2, 4])],
)
def test_gpu_counts_are_one_two_and_all(gpus: tuple[int, ...], counts: list[int]) -> None:
    assert gpu_counts(gpus) == counts


def test_every_shipped_workload_script_is_in_the_package() -> None:
    for name in ("cpu", "pytorch", "tensorflow"):
        script = builtin(name).script
        assert script is not None and (SCRIPTS / script).is_file()


@pytest.mark.parametrize(("count", "host_gpus"), [(1, "4"), (2, "4,5"), (4, "4,5,6,7")])
def test_pytorch_command_lines_for_one_two_and_all_gpus(count: int, host_gpus: str) -> None:
    workload = builtin("pytorch", ["--precision", "amp"])
    gpus = (4, 5, 6, 7)[:count]
    host = workload.argv(Path("/tmp/scripts"), "/usr/bin/python3", count)
    assert host == [
        "/usr/bin/python3", "/tmp/scripts/resnet50_torch.py", "--gpus", str(count),
        "--precision", "amp",
    ]  # fmt: skip
    environment = host_environment({"PATH": "/usr/bin"}, gpus)
    assert environment["CUDA_VISIBLE_DEVICES"] == host_gpus
    assert environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert environment["GPURESA_BENCH_GPUS"] == str(count)
    assert environment["PATH"] == "/usr/bin"
    inside = workload.argv(CONTAINER_SCRIPTS, CONTAINER_PYTHON, count)
    assert inside == [
        "python3", "/opt/gpuresa-bench/resnet50_torch.py", "--gpus", str(count),
        "--precision", "amp",
    ]  # fmt: skip
    # the container gets exactly those GPUs, as a session would (nvidia mode: explicit ids)
    config = make_config(gpus=(4, 5, 6, 7))
    payload = oneshot_payload(
        config,
        "gpuresa/pytorch:12.4-x",
        inside,
        gpu_access(config.host(), gpus),
        [(Path("/tmp/scripts"), PurePosixPath(CONTAINER_SCRIPTS))],
        {"GPURESA_BENCH_GPUS": str(count)},
    )
    assert payload["Entrypoint"] == inside
    assert payload["HostConfig"]["DeviceRequests"] == [
        {
            "Driver": "nvidia",
            "Count": 0,
            "DeviceIDs": host_gpus.split(","),
            "Capabilities": [["gpu"]],
            "Options": {},
        }
    ]
    environment_inside = dict(item.split("=", 1) for item in payload["Env"])
    assert environment_inside["NVIDIA_VISIBLE_DEVICES"] == host_gpus
    assert environment_inside["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(count)))


def test_tensorflow_command_line() -> None:
    workload = builtin("tensorflow")
    assert workload.argv(CONTAINER_SCRIPTS, CONTAINER_PYTHON, 2) == [
        "python3", "/opt/gpuresa-bench/resnet50_tf.py", "--gpus", "2",
    ]  # fmt: skip
    assert workload.check_argv(Path("/s"), "python3") == [
        "python3", "/s/resnet50_tf.py", "--check", "--gpus", "0",
    ]  # fmt: skip


def test_an_admins_command_runs_through_the_shell_on_both_sides() -> None:
    workload = shell_command("python3 train.py --epochs 1")
    expected = ["/bin/sh", "-c", "python3 train.py --epochs 1"]
    assert workload.argv(Path("/s"), "python3", 2) == expected
    assert workload.argv(CONTAINER_SCRIPTS, CONTAINER_PYTHON, 2) == expected
    assert workload.check_argv(Path("/s"), "python3") is None
    with pytest.raises(UserError, match="--command"):
        shell_command("  ")


def test_oneshot_payload_has_the_session_limits_and_nothing_for_people() -> None:
    config = make_config()
    payload = oneshot_payload(
        config, "image", ["python3", "x.py"], gpu_access(config.host(), (0,)), [], {}
    )
    host = payload["HostConfig"]
    assert host["NanoCpus"] == 8_000_000_000
    assert host["Memory"] == 64 * 1024**3
    assert host["ShmSize"] == 1024**3
    assert host["PidsLimit"] == 1024
    assert host["NetworkMode"] == "none"
    assert host["CapDrop"] == ["ALL"] and host["CapAdd"] == []
    assert host["Privileged"] is False and host["Init"] is True
    assert "PortBindings" not in host
    assert payload["Labels"] == {BENCH_LABEL: "gpu1"}
    # never mistaken for a session: no session label at all
    assert HOST_LABEL not in payload["Labels"] and KEY_LABEL not in payload["Labels"]


def test_devices_mode_gives_the_same_device_nodes_as_a_session() -> None:
    config = make_config(gpu_mode="devices")
    devices = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"}
    payload = oneshot_payload(
        config, "image", ["true"], gpu_access(config.host(), (1,), devices), [], {}
    )
    paths = [device["PathOnHost"] for device in payload["HostConfig"]["Devices"]]
    assert paths == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]


@pytest.mark.parametrize(
    ("template", "framework"),
    [("pytorch", "pytorch"), ("torch-nightly", "pytorch"), ("tensorflow", "tensorflow"),
     ("digits", "tensorflow")],
)  # fmt: skip
def test_framework_follows_the_template(template: str, framework: str) -> None:
    assert framework_of(template) == framework


def test_an_unknown_template_framework_asks_for_workload() -> None:
    with pytest.raises(UserError, match="--workload"):
        framework_of("jax")


# --- the runs, interleaved, with recorded outputs --------------------------------------------


@dataclasses.dataclass
class Replay:
    """A side that answers with recorded outputs and remembers what it was asked to run."""

    name: str
    outputs: list[RunOutput]
    calls: list[tuple[list[str], tuple[int, ...]]] = dataclasses.field(default_factory=list)
    log: list[str] | None = None

    def command(self, workload: Workload, gpu_count: int) -> list[str]:
        if self.name == HOST:
            return workload.argv(Path("/tmp/s"), "python3", gpu_count)
        return workload.argv(CONTAINER_SCRIPTS, CONTAINER_PYTHON, gpu_count)

    def run(self, command: Sequence[str], gpus: tuple[int, ...]) -> RunOutput:
        self.calls.append((list(command), gpus))
        if self.log is not None:
            self.log.append(self.name)
        return self.outputs.pop(0)


def recorded(value: float, unit: str = "images/s", seconds: float = 30.0) -> RunOutput:
    text = (FIXTURES / "h100-pytorch-1gpu-fp32-1.out").read_text()
    return RunOutput(0, text.replace("2248.14 images/s", f"{value} {unit}"), "", seconds)


def test_recorded_h100_runs_make_a_comparison() -> None:
    """Three recorded H100 runs replayed on both sides: equal medians, ratio 1, within spread."""
    outputs = [(FIXTURES / f"h100-pytorch-1gpu-fp32-{run}.out").read_text() for run in (1, 2, 3)]
    host = Replay(HOST, [RunOutput(0, text, "", 40.0) for text in outputs])
    container = Replay(CONTAINER, [RunOutput(0, text, "", 41.0) for text in outputs])
    samples, info = run_bench(builtin("pytorch"), (0,), [1], 3, [host, container])
    [comparison] = compare(samples, info)
    assert comparison.host == (2248.14, 2262.93, 2210.49)
    assert comparison.host_median == 2248.14 and comparison.ratio == 1.0
    assert comparison.within_spread
    assert comparison.unit == "images/s"
    assert "host: model: resnet50 (torchvision, 25557032 parameters)" in info
    assert comparison.verdict().startswith(
        "1 GPU (0): host 2248.1, container 2248.1 images/s, ratio 1.000 (+0.0 %"
    )


def test_a_side_that_sees_fewer_gpus_is_refused_with_its_reason() -> None:
    framework = (FIXTURES / "h100-pytorch-check.out").read_text()
    error = (FIXTURES / "h100-pytorch-2gpus-on-1.err").read_text()
    host = Replay(HOST, [RunOutput(4, framework, error, 5.0)])
    with pytest.raises(BenchFailed, match=r"host sees fewer GPUs.*2 GPU\(s\) asked, 1 visible"):
        run_bench(builtin("pytorch"), (0, 1), [2], 1, [host])


def test_runs_alternate_host_and_container_for_each_gpu_count() -> None:
    order: list[str] = []
    host = Replay(HOST, [recorded(value) for value in (100, 101, 200, 202, 400, 390)], log=order)
    container = Replay(
        CONTAINER, [recorded(value) for value in (99, 102, 201, 199, 395, 401)], log=order
    )
    samples, info = run_bench(builtin("pytorch"), (0, 1, 2, 3), [1, 2, 4], 2, [host, container])
    assert order == [HOST, CONTAINER] * 6
    everything = (0, 1, 2, 3)
    assert [gpus for _, gpus in host.calls] == [(0,), (0,), (0, 1), (0, 1), everything, everything]
    assert [command[3] for command, _ in container.calls] == ["1", "1", "2", "2", "4", "4"]
    assert info[0].startswith("host: framework: torch")
    comparisons = compare(samples, info)
    assert [comparison.gpus for comparison in comparisons] == [(0,), (0, 1), (0, 1, 2, 3)]
    assert comparisons[0].host == (100.0, 101.0) and comparisons[0].container == (99.0, 102.0)
    assert all(comparison.within_spread for comparison in comparisons)
    assert comparisons[2].label == "4 GPUs (0,1,2,3)"


def test_a_host_without_the_framework_is_told_what_to_install() -> None:
    missing = RunOutput(3, "", "error: PyTorch is not installed for /usr/bin/python3\n", 0.1)
    host = Replay(HOST, [missing])
    workload = builtin("pytorch")
    with pytest.raises(BenchFailed, match=r"(?s)host's Python has no PyTorch .*--host-python"):
        check_framework(host, workload, workload.check_argv(Path("/s"), "python3"))


def test_a_container_without_the_framework_is_told_to_choose_a_template() -> None:
    host = Replay(HOST, [recorded(100)])
    container = Replay(CONTAINER, [RunOutput(3, "", "error: no torch\n", 1.0)])
    with pytest.raises(BenchFailed, match=r"(?s)container's Python has no PyTorch.*--template"):
        run_bench(builtin("pytorch"), (0,), [1], 1, [host, container])


def test_a_failed_run_quotes_its_output() -> None:
    host = Replay(HOST, [RunOutput(1, "", "Traceback ...\nRuntimeError: CUDA out of memory\n", 1)])
    with pytest.raises(BenchFailed, match=r"(?s)exit code 1.*CUDA out of memory"):
        run_bench(builtin("pytorch"), (0,), [1], 1, [host])


def test_a_run_without_a_number_is_refused() -> None:
    host = Replay(HOST, [RunOutput(0, "all done\n", "", 1)])
    with pytest.raises(BenchFailed, match="no measurement"):
        run_bench(shell_command("true"), (), [0], 1, [host])


def test_cpu_runs_that_did_different_work_are_refused() -> None:
    host = Replay(HOST, [RunOutput(0, "checksum: 1\nresult: 5 matmul/s\n", "", 1)])
    container = Replay(CONTAINER, [RunOutput(0, "checksum: 2\nresult: 5 matmul/s\n", "", 1)])
    with pytest.raises(BenchFailed, match="different work"):
        run_bench(builtin("cpu"), (), [0], 1, [host, container])


# --- the statistics --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "container", "ratio", "within"),
    [
        ((100, 102, 98), (99, 101, 100), 1.0, True),
        ((100, 101, 102), (90, 91, 92), 91 / 101, False),  # every container run is slower
        ((100, 101, 102), (103, 104, 105), 104 / 101, False),  # every container run is faster
        ((100,), (100,), 1.0, True),
        ((50, 150), (60, 140), 1.0, True),  # wide spread hides a difference
    ],
)
def test_ratio_and_spread(
    host: tuple[float, ...], container: tuple[float, ...], ratio: float, within: bool
) -> None:
    comparison = Comparison((0,), "images/s", host, container)
    assert comparison.ratio == pytest.approx(ratio)
    assert comparison.within_spread is within
    low, high = comparison.ratio_interval
    assert low == pytest.approx(min(container) / max(host))
    assert high == pytest.approx(max(container) / min(host))
    assert ("within the spread" in comparison.verdict()) is within


def test_summary_names_each_gpu_set() -> None:
    samples = [
        Sample(HOST, (), 10.0, "matmul/s", 1.0),
        Sample(CONTAINER, (), 9.0, "matmul/s", 1.0),
    ]
    text = summary(compare(samples))
    assert text.startswith("CPU: host 10, container 9 matmul/s, ratio 0.900 (-10.0 %")


def test_compare_refuses_a_gpu_set_with_one_side_only() -> None:
    with pytest.raises(ValueError, match="missing"):
        compare([Sample(HOST, (0,), 1.0, "images/s", 1.0)])


# --- GPUs the bench must not touch ------------------------------------------------------------


def session(key: str, gpus: tuple[int, ...], state: str = "running") -> Session:
    return Session(
        key=key, user="alice", host="gpu1", template="pytorch", cuda="12.4",
        gpu_count=len(gpus), gpu_indices=gpus,
        start=NOW - timedelta(hours=1), end=NOW + timedelta(hours=1), ssh_port=20000,
        ftp_port=21000, ftp_passive_first=22000, ftp_passive_last=22009, state=state,
        output_dir=Path("/srv/out"),
    )  # fmt: skip


def booking(key: str, gpus: int, starts_in: timedelta, user: str = "bob") -> Reservation:
    return Reservation(
        key=key, uid=key, recurrence_id=None, calendar="lab", host="gpu1", user=user,
        template="pytorch", cuda=None, gpus=gpus, start=NOW + starts_in,
        end=NOW + starts_in + timedelta(hours=2),
    )  # fmt: skip


def holders(sessions: list[Session], reservations: list[Reservation]) -> dict[int, str]:
    config = make_config()
    inventory = Inventory(config.host(), (0, 1, 2, 3))
    return gpu_holders(sessions, reservations, inventory, NOW, NOW + timedelta(minutes=30), config)


def test_sessions_hold_their_gpus_whatever_their_state() -> None:
    found = holders([session("a", (0,)), session("b", (2,), state="stopped")], [])
    assert sorted(found) == [0, 2]
    assert "session a of alice" in found[0]


def test_a_booking_starting_within_the_window_holds_the_gpus_the_planner_gives_it() -> None:
    # the planner gives the lowest free GPUs: 1 and 2, since the (ad-hoc) session holds 0
    found = holders([session("adhoc-a", (0,))], [booking("soon", 2, timedelta(minutes=20))])
    assert sorted(found) == [0, 1, 2]
    assert found[1].startswith("booking soon of bob from 2026-03-02 09:20")


def test_a_booking_that_runs_now_without_a_session_holds_gpus() -> None:
    found = holders([], [booking("late", 1, timedelta(minutes=-10))])
    assert sorted(found) == [0]


def test_a_booking_after_the_window_holds_nothing() -> None:
    assert holders([], [booking("later", 4, timedelta(hours=2))]) == {}


def test_another_hosts_booking_holds_nothing() -> None:
    elsewhere = dataclasses.replace(booking("x", 1, timedelta(minutes=5)), host="gpu2")
    assert holders([], [elsewhere]) == {}


# --- the options ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gpu_mode", "message"),
    [
        ("0,7", "nvidia", "has no GPU 7"),
        ("1,1", "nvidia", "repeats"),
        ("0", "none", "gpu_mode 'none'"),
        ("zero", "nvidia", "expected GPU indices"),
    ],
)
def test_bad_gpu_choices_are_refused(text: str, gpu_mode: str, message: str) -> None:
    config = make_config(gpu_mode=gpu_mode)
    available = (0, 1, 2, 3) if gpu_mode != "none" else ()
    with pytest.raises(UserError, match=message):
        choose_gpus(text, available, config)


def test_gpus_default_to_every_gpu_of_the_host() -> None:
    assert choose_gpus(None, (0, 1, 2, 3), make_config()) == (0, 1, 2, 3)
    assert choose_gpus("2,3", (0, 1, 2, 3), make_config()) == (2, 3)


def test_workload_follows_the_template_with_gpus_and_is_cpu_without() -> None:
    arguments = build_parser().parse_args(["bench"])
    assert choose_workload(arguments, "tensorflow", (0, 1)).name == "tensorflow"
    assert choose_workload(arguments, "tensorflow", ()).name == "cpu"
    arguments = build_parser().parse_args(["bench", "--workload-args", "--rounds 5"])
    assert choose_workload(arguments, "pytorch", ()).arguments == ("--rounds", "5")


def test_a_command_cannot_be_mixed_with_a_shipped_workload() -> None:
    arguments = build_parser().parse_args(["bench", "--command", "true", "--workload", "cpu"])
    with pytest.raises(UserError, match="--command replaces"):
        choose_workload(arguments, "pytorch", ())
