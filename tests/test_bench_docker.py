"""`gpuresa bench` on the real Docker engine: the CPU path end to end, refusals, clean-up.

The container side runs in the pytorch template's image built on the local
base image (no PyTorch in it: the CPU workload and shell commands only need
python3 and sh). Each test has its own config and state folder in tmp_path.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import BASE_IMAGE, TEST_HOST, DockerHarness

from gpuresa.backends.engines import Runtime
from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.oneshot import BENCH_LABEL, OneShot, OneShotTimeout
from gpuresa.cli import main
from gpuresa.config.reading import load_config
from gpuresa.journal.store import Journal
from gpuresa.model import Reservation, Session

pytestmark = pytest.mark.docker


def write_config(root: Path, gpu_mode: str = "none", gpus: tuple[int, ...] = ()) -> Path:
    path = root / "config.toml"
    path.write_text(
        f"""
[daemon]
host = "{TEST_HOST}"
state_dir = "{root / "state"}"

[[hosts]]
name = "{TEST_HOST}"
gpus = [{", ".join(map(str, gpus))}]
gpu_mode = "{gpu_mode}"
bind_address = "127.0.0.1"

[templates]
base_image = "{BASE_IMAGE}"

[limits]
shm_size = "256m"
pids = 512
"""
    )
    return path


def bench_containers(client: Any) -> list[Any]:
    return list(client.containers.list(all=True, filters={"label": f"{BENCH_LABEL}={TEST_HOST}"}))


@pytest.fixture
def docker(docker_harness: DockerHarness) -> Iterator[DockerHarness]:
    """The harness, plus removal of any bench container a failed test left."""
    yield docker_harness
    for container in bench_containers(docker_harness.client):
        container.remove(force=True)


def history(config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["history", "--config", str(config)]) == 0
    return capsys.readouterr().out


def test_cpu_bench_compares_host_and_container_and_journals_it(
    tmp_path: Path, docker: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    code = main(
        ["bench", "--config", str(config), "--runs", "2", "--json", "--workload-args",
         "--rounds 5 --size 48"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["host"] == TEST_HOST
    assert report["workload"] == "cpu" and report["command"] is None
    assert report["template"] == "pytorch" and report["image"].startswith("gpuresa/pytorch:")
    assert report["gpus"] == [] and report["runs"] == 2
    samples = report["samples"]
    assert [sample["side"] for sample in samples] == ["host", "container"] * 2
    assert [sample["run"] for sample in samples] == [1, 1, 2, 2]
    assert all(sample["value"] > 0 and sample["unit"] == "matmul/s" for sample in samples)
    [comparison] = report["comparisons"]
    host = [sample["value"] for sample in samples if sample["side"] == "host"]
    container = [sample["value"] for sample in samples if sample["side"] == "container"]
    assert comparison["host"] == host and comparison["container"] == container
    assert comparison["ratio"] == pytest.approx(
        comparison["container_median"] / comparison["host_median"]
    )
    low, high = comparison["ratio_interval"]
    assert low == pytest.approx(min(container) / max(host))
    assert high == pytest.approx(max(container) / min(host))
    assert comparison["within_spread"] is (low <= 1 <= high)
    assert report["within_spread"] is comparison["within_spread"]
    # the same work on both sides, each with its own Python
    assert any(line.startswith("host: framework: python 3.") for line in report["info"])
    assert any(line.startswith("container: framework: python 3.") for line in report["info"])
    assert "container: workload: cpu-matmul size=48 rounds=5" in report["info"]
    # progress went to stderr, each run as it ended
    assert captured.err.count(" matmul/s ") == 4
    assert bench_containers(docker.client) == []
    shown = history(config, capsys)
    assert f"@bench:{TEST_HOST}" in shown
    assert "bench cpu on pytorch 12.4, GPUs none: ok" in shown
    assert f"ratio {comparison['ratio']:.3f}" in shown


def test_a_command_runs_inside_the_container_and_on_the_host(
    tmp_path: Path, docker: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the container has the scripts at /opt/gpuresa-bench: the ratio shows where each ran."""
    config = write_config(tmp_path)
    command = (
        'echo "gpus=$GPURESA_BENCH_GPUS"; '
        "if [ -r /opt/gpuresa-bench/cpu_matmul.py ]; then echo 'result: 3 widgets'; "
        "else echo 'result: 2 widgets'; fi"
    )
    code = main(["bench", "--config", str(config), "--runs", "2", "--command", command])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "bench command on pytorch 12.4" in captured.out
    assert "CPU: host 2, container 3 widgets, ratio 1.500 (+50.0 %" in captured.out
    assert "outside the spread" in captured.out


def test_a_command_without_a_number_fails_and_is_journaled(
    tmp_path: Path, docker: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    code = main(["bench", "--config", str(config), "--runs", "1", "--command", "echo done"])
    captured = capsys.readouterr()
    assert code == 1
    assert "printed no measurement on the host" in captured.err
    assert "bench command on pytorch 12.4, GPUs none: failed" in history(config, capsys)


def _session(key: str, gpus: tuple[int, ...]) -> Session:
    now = datetime.now(UTC)
    return Session(
        key=key, user="alice", host=TEST_HOST, template="pytorch", cuda="12.4",
        gpu_count=len(gpus), gpu_indices=gpus,
        start=now - timedelta(hours=1), end=now + timedelta(hours=1), ssh_port=20000,
        ftp_port=21000, ftp_passive_first=22000, ftp_passive_last=22009, state="running",
        output_dir=Path("/srv/out"),
    )  # fmt: skip


@pytest.mark.parametrize("gpus", [["--gpus", "0,1"], ["--gpus", "0"], []])
def test_gpus_a_session_holds_are_refused(
    tmp_path: Path,
    docker: DockerHarness,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    gpus: list[str],
) -> None:
    config = write_config(tmp_path, gpu_mode="nvidia", gpus=(0, 1))
    # the runtime's view of Docker: a session holds GPU 0
    monkeypatch.setattr(Runtime, "list_sessions", lambda self: [_session("adhoc-x1", (0,))])
    code = main(["bench", "--config", str(config), *gpus])
    captured = capsys.readouterr()
    assert code == 1
    assert "GPU(s) 0 are held" in captured.err
    assert "session adhoc-x1 of alice" in captured.err
    assert "--gpus 1" in captured.err
    assert bench_containers(docker.client) == []
    assert not (tmp_path / "state" / "journal.sqlite").exists()


def test_gpus_of_a_booking_about_to_start_are_refused(
    tmp_path: Path, docker: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path, gpu_mode="nvidia", gpus=(0, 1))
    config = load_config(str(config_path))
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=10)
    booking = Reservation(
        key="lab-42", uid="lab-42", recurrence_id=None, calendar="lab", host=TEST_HOST,
        user="bob", template="pytorch", cuda=None, gpus=1, start=start,
        end=start + timedelta(hours=1),
    )  # fmt: skip
    with Journal(config.daemon.state_dir / "journal.sqlite") as journal:
        journal.reservations.record([booking], [], datetime.now(UTC))
    code = main(["bench", "--config", str(config_path), "--gpus", "0"])
    captured = capsys.readouterr()
    assert code == 1
    assert "booking lab-42 of bob" in captured.err
    # the booking starts after a 5-minute window: GPU 0 is free for that long
    code = main(
        ["bench", "--config", str(config_path), "--gpus", "0", "--window", "5m",
         "--host-python", sys.executable]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1
    assert "held" not in captured.err
    # gpuresa's own Python has no PyTorch: refused before any image or container
    assert "the host's Python has no PyTorch" in captured.err
    assert "--host-python" in captured.err
    assert bench_containers(docker.client) == []


def test_a_bench_container_is_no_session_and_leftovers_are_removed(
    tmp_path: Path, docker: DockerHarness
) -> None:
    config = load_config(str(write_config(tmp_path)))
    leftover = docker.client.containers.run(
        BASE_IMAGE, ["sleep", "300"], detach=True, labels={BENCH_LABEL: TEST_HOST}
    )
    runtime = Runtime(config, docker.client)
    assert runtime.list_sessions() == []
    oneshot = OneShot(config, Engine(docker.client))
    assert oneshot.remove_leftovers() == [leftover.name]
    assert bench_containers(docker.client) == []


def test_a_one_shot_that_runs_too_long_is_removed(tmp_path: Path, docker: DockerHarness) -> None:
    config = load_config(str(write_config(tmp_path)))
    oneshot = OneShot(config, Engine(docker.client))
    with pytest.raises(OneShotTimeout, match="did not finish within 1 s"):
        oneshot.run(BASE_IMAGE, ["sleep", "60"], timeout=1)
    assert bench_containers(docker.client) == []
    result = oneshot.run(BASE_IMAGE, ["sh", "-c", "echo out; echo err >&2; exit 7"], timeout=60)
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
    assert bench_containers(docker.client) == []
