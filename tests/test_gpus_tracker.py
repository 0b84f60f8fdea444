"""Use per booking, idle bookings, unbooked processes and lost GPUs.

Snapshots are the real H100 readings recorded in tests/corpus/gpus with their
processes replaced by real processes of this machine, so that the tracker's
reading of /proc and of the cgroups (cgroups v1 here) is the real thing.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import DockerHarness
from nvml_replay import RecordedNvml
from support.gpu_nodes import gpu_nodes_left_as_they_are
from support.waiting import wait_for

from gpuresa.gpus import cgroups
from gpuresa.gpus.findings import GpuLostFromHost, GpuLostInSession, IdleBooking, UnbookedProcess
from gpuresa.gpus.readings import GpuProcess, GpuReading, GpuSnapshot
from gpuresa.gpus.telemetry import Telemetry
from gpuresa.gpus.tracker import HostInspector, IdlePolicy, SessionContainer, UsageTracker
from gpuresa.gpus.usage_store import UsageStore
from gpuresa.model import Session

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
BUSY = Telemetry("nvml", nvml=RecordedNvml("busy")).sample(T0).gpus[0]
IDLE = Telemetry("nvml", nvml=RecordedNvml("idle")).sample(T0).gpus[0]
UUID = BUSY.uuid
BUSY_PERCENT = BUSY.utilization or 0


def session(key: str = "k1", gpus: tuple[int, ...] = (0,), state: str = "running") -> Session:
    return Session(
        key=key, user="alice", host="h", template="pytorch", cuda=None,
        gpu_count=len(gpus), gpu_indices=gpus,
        start=T0, end=T0 + timedelta(hours=8), ssh_port=20000, ftp_port=21000,
        ftp_passive_first=22000, ftp_passive_last=22009, state=state,
        output_dir=Path("/tmp/out"), email="alice@example.org",
    )  # fmt: skip


def snapshot(at: datetime, *readings: GpuReading) -> GpuSnapshot:
    return GpuSnapshot(at, "nvml", readings)


def reading(base: GpuReading, *pids: int, uuid: str = UUID, minor: int = 0) -> GpuReading:
    same = base.processes[0].used_memory if base.processes else None
    processes = tuple(GpuProcess(pid, same) for pid in pids)
    return dataclasses.replace(base, processes=processes, uuid=uuid, minor=minor)


@pytest.fixture(autouse=True)
def steady_gpu_nodes() -> Iterator[None]:
    """No test makes stand-in /dev/nvidia* nodes meanwhile: the tracker reads the host's
    nodes, and one made by a test on another worker would look like a GPU a session lost."""
    with gpu_nodes_left_as_they_are():
        yield


@pytest.fixture
def store(tmp_path: Path) -> Iterator[UsageStore]:
    usage = UsageStore(tmp_path / "gpu-usage.sqlite")
    yield usage
    usage.close()


def test_use_per_booking_is_averaged_and_kept_after_the_end(store: UsageStore) -> None:
    tracker = UsageTracker(store)
    tracker.observe(T0, [session()], snapshot(T0, reading(BUSY)))
    tracker.observe(T0 + timedelta(minutes=1), [session()], snapshot(T0, reading(IDLE)))
    running = store.uses(running=True)["k1"]
    assert running.samples == 2
    assert running.current_utilization == IDLE.utilization == 0
    assert running.average_utilization == pytest.approx(BUSY_PERCENT / 2)
    assert store.bound_gpus() == {"k1": {0: UUID}}
    tracker.observe(T0 + timedelta(minutes=2), [], snapshot(T0, reading(IDLE)))
    ended = store.uses(running=False)["k1"]
    assert ended.ended == T0 + timedelta(minutes=2)
    assert ended.average_utilization == pytest.approx(BUSY_PERCENT / 2)


def test_a_snapshot_nobody_could_read_records_and_concludes_nothing(store: UsageStore) -> None:
    tracker = UsageTracker(store)
    broken = GpuSnapshot(T0, "none", error="NVML cannot start")
    for minute in range(10):
        assert tracker.observe(T0 + timedelta(minutes=minute), [session()], broken) == []
    assert store.uses() == {}


@pytest.mark.parametrize(
    ("utilizations", "expected_at"),
    [
        ([0, 0, 0, 0], 2),  # idle from the first sample: due after 10 minutes
        ([0, 0, 50, 0, 0, 0, 0], 5),  # one busy sample starts the count again
        ([4, 3, 4, 4], 2),  # under the threshold of 5 %
        ([5, 0, 5, 0, 5, 0], None),  # at the threshold counts as used
    ],
)
def test_an_idle_booking_is_reported_once_after_idle_after(
    store: UsageStore, utilizations: list[int], expected_at: int | None
) -> None:
    tracker = UsageTracker(store, IdlePolicy(threshold=5, after=timedelta(minutes=10)))
    found: list[tuple[int, Any]] = []
    for step, value in enumerate(utilizations):
        now = T0 + timedelta(minutes=5 * step)
        gpu = dataclasses.replace(reading(IDLE), utilization=value)
        found += [(step, item) for item in tracker.observe(now, [session()], snapshot(now, gpu))]
    if expected_at is None:
        assert found == []
        return
    ((step, finding),) = found
    assert step == expected_at and isinstance(finding, IdleBooking)
    assert finding.key == "k1" and finding.user == "alice" and finding.audience == "user"
    assert finding.now - finding.idle_since == timedelta(minutes=10)
    assert "idle for 10 min" in finding.text() and "threshold 5 %" in finding.text()
    assert tracker.view.idle == frozenset({"k1"})


def test_an_idle_notice_is_not_repeated_by_a_restarted_daemon(store: UsageStore) -> None:
    policy = IdlePolicy(threshold=5, after=timedelta(minutes=5), action="notify-admin")
    first = UsageTracker(store, policy)
    findings = []
    for step in range(3):
        now = T0 + timedelta(minutes=5 * step)
        findings += first.observe(now, [session()], snapshot(now, reading(IDLE)))
    assert [type(item) for item in findings] == [IdleBooking]
    assert isinstance(findings[0], IdleBooking) and findings[0].audience == "user+admin"
    again = UsageTracker(store, policy)
    for step in range(3, 6):
        now = T0 + timedelta(minutes=5 * step)
        assert again.observe(now, [session()], snapshot(now, reading(IDLE))) == []


@pytest.fixture
def nobody_process() -> Iterator[int]:
    process = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                "sleep", "300"])  # fmt: skip
    # setpriv changes user, then becomes sleep: wait for both (a loaded machine is slow)
    comm = Path(f"/proc/{process.pid}/comm")
    try:
        wait_for(lambda: comm.read_text().strip() == "sleep", 10, "setpriv to become sleep")
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_a_host_process_on_a_booked_gpu_is_reported_once_with_its_user(
    store: UsageStore, nobody_process: int
) -> None:
    tracker = UsageTracker(store)
    gpu = reading(BUSY, nobody_process)
    (finding,) = tracker.observe(T0, [session()], snapshot(T0, gpu))
    assert isinstance(finding, UnbookedProcess)
    assert (finding.pid, finding.host_user, finding.command) == (nobody_process, "nobody", "sleep")
    assert finding.container_id is None and finding.where == "the host"
    assert (finding.holder_key, finding.holder_user, finding.gpu_uuid) == ("k1", "alice", UUID)
    assert "booked by alice (k1)" in finding.text()
    # still there a minute later: shown (view) but not reported again
    later = T0 + timedelta(minutes=1)
    assert tracker.observe(later, [session()], snapshot(later, gpu)) == []
    assert [item.pid for item in tracker.view.unbooked] == [nobody_process]


def test_a_process_on_a_gpu_nobody_booked_is_reported(
    store: UsageStore, nobody_process: int
) -> None:
    (finding,) = UsageTracker(store).observe(T0, [], snapshot(T0, reading(BUSY, nobody_process)))
    assert isinstance(finding, UnbookedProcess) and finding.holder_key is None
    assert "not booked by anyone" in finding.text()


@pytest.mark.docker
def test_container_processes_are_told_apart_by_their_cgroup(
    store: UsageStore, docker_harness: DockerHarness
) -> None:
    own = docker_harness.run(command=["sleep", "300"])
    stranger = docker_harness.run(command=["sleep", "300"])
    own.reload()
    stranger.reload()
    own_pid, stranger_pid = own.attrs["State"]["Pid"], stranger.attrs["State"]["Pid"]
    assert cgroups.container_of(own_pid) == own.id
    assert cgroups.container_of(os.getpid()) is None
    containers = [SessionContainer(own.id, "k1", "main")]
    tracker = UsageTracker(store)
    findings = tracker.observe(
        T0, [session()], snapshot(T0, reading(BUSY, own_pid, stranger_pid)), containers
    )
    # the booking's own process is its business; the other container's is not
    ((finding),) = findings
    assert isinstance(finding, UnbookedProcess)
    assert finding.pid == stranger_pid and finding.container_id == stranger.id
    assert finding.container_key is None and finding.where == f"container {stranger.id[:12]}"
    # a session using a GPU that another session booked is unbooked use too
    other = snapshot(T0, reading(BUSY, own_pid, uuid="GPU-other", minor=1))
    (crossed,) = UsageTracker(store).observe(
        T0, [session(), session("k2", gpus=(1,))], other, containers
    )
    assert isinstance(crossed, UnbookedProcess) and crossed.container_key == "k1"
    assert crossed.where == "session k1"


@pytest.fixture
def stand_in_gpu_node() -> Iterator[Path]:
    """A char node 195:7 (NVIDIA's major) at a path of this test's own; removed after."""
    path = Path(f"/dev/gpuresa-test-{os.getpid()}-nvidia7")
    subprocess.run(["mknod", "-m", "0666", str(path), "c", "195", "7"], check=True)
    yield path
    path.unlink()


@pytest.mark.docker
def test_a_gpu_lost_inside_a_session_is_seen_from_its_device_cgroup(
    store: UsageStore, docker_harness: DockerHarness, stand_in_gpu_node: Path
) -> None:
    assert cgroups.cgroup_version() == 1, "this test machine runs cgroups v1"
    node = str(stand_in_gpu_node)
    main = docker_harness.run(command=["sleep", "300"], devices=[f"{node}:{node}:rwm"])
    containers = [SessionContainer(main.id, "k1", "main")]
    pattern = node.replace("nvidia7", "nvidia{minor}")
    tracker = UsageTracker(store, inspector=HostInspector(device_pattern=pattern))
    gpu = reading(BUSY, minor=7)
    assert tracker.observe(T0, [session()], snapshot(T0, gpu), containers) == []
    # what a host `systemctl daemon-reload` does to the container's device rules
    rules = Path("/sys/fs/cgroup/devices/docker") / main.id
    assert "c 195:7 rwm" in (rules / "devices.list").read_text()
    (rules / "devices.deny").write_text("c 195:7 rwm")
    later = T0 + timedelta(minutes=1)
    (finding,) = tracker.observe(later, [session()], snapshot(later, gpu), containers)
    assert isinstance(finding, GpuLostInSession)
    assert (finding.key, finding.container_id, finding.gpus) == ("k1", main.id, (0,))
    assert "recreated" in finding.text() and "output" in finding.text()
    assert tracker.view.lost == frozenset({"k1"})
    # told once per container: the recreated session has a new container id
    again = T0 + timedelta(minutes=2)
    assert tracker.observe(again, [session()], snapshot(again, gpu), containers) == []


def test_device_rules_under_cgroups_v2_are_unknown_never_lost(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    assert cgroups.device_access("ab" * 32, [(195, 0)], root=tmp_path) is None
    assert cgroups.device_access("ab" * 32, [(195, 0)]) is None  # no such container here


@pytest.mark.parametrize(
    ("rules", "allowed"),
    [
        ("c 195:0 rwm", True),
        ("c 195:* rwm", True),
        ("a *:* rwm", True),
        ("c 195:0 rm", False),
        ("c 195:1 rwm\nc 1:3 rwm", False),
        ("b 195:0 rwm", False),
        ("", False),
    ],
)
def test_device_rules_are_read_as_the_kernel_does(
    tmp_path: Path, rules: str, allowed: bool
) -> None:
    folder = tmp_path / "devices" / "docker" / ("c" * 64)
    folder.mkdir(parents=True)
    (folder / "devices.list").write_text(rules + "\n")
    assert cgroups.device_access("c" * 64, [(195, 0)], root=tmp_path) is allowed


ID = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("text", "container"),
    [
        (f"12:devices:/docker/{ID}\n0::/docker/{ID}", ID),  # v1, cgroupfs driver (this machine)
        (f"0::/system.slice/docker-{ID}.scope", ID),  # v2, systemd driver
        (f"0::/machine.slice/libpod-{ID}.scope/container", ID),  # Podman
        ("0::/user.slice/user-1000.slice/session-3.scope", None),
        # the GPU machine's own process (recorded): a 32-hex sandbox name, no container
        ("0::/process_api/b0e6873360e6f5df9775e690a909a201", None),
        (f"0::/docker/{ID[:-1]}", None),
        ("", None),
    ],
)
def test_container_ids_are_read_from_cgroup_paths(text: str, container: str | None) -> None:
    assert cgroups.container_in_cgroup_file(text) == container


def test_a_gpu_gone_from_the_host_is_reported_after_two_readable_misses(
    store: UsageStore,
) -> None:
    tracker = UsageTracker(store)
    first = snapshot(T0, reading(BUSY))
    assert tracker.observe(T0, [session("k1"), session("k2", gpus=())], first) == []
    gone = [T0 + timedelta(minutes=step) for step in (1, 2, 3)]
    broken = GpuSnapshot(gone[0], "none", error="NVML cannot count the GPUs")
    assert tracker.observe(gone[0], [session("k1")], broken) == []
    assert tracker.observe(gone[0], [session("k1")], snapshot(gone[0])) == []
    (finding,) = tracker.observe(gone[1], [session("k1")], snapshot(gone[1]))
    assert isinstance(finding, GpuLostFromHost)
    assert (finding.gpu_uuid, finding.gpu_index, finding.keys) == (UUID, 0, ("k1",))
    assert tracker.observe(gone[2], [session("k1")], snapshot(gone[2])) == []
    assert tracker.view.lost == frozenset({"k1"})


def test_history_shows_the_average_gpu_use_of_ended_sessions(tmp_path: Path) -> None:
    """`gpuresa history` reads the sampler's store next to the journal."""
    import sys

    from gpuresa.config.reading import load_config
    from gpuresa.daemon import journal_path
    from gpuresa.journal.store import Journal

    config_file = tmp_path / "config.toml"
    config_file.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    config = load_config(config_file)
    journal_path(config).parent.mkdir(parents=True, exist_ok=True)
    Journal(journal_path(config)).close()
    usage = UsageStore(tmp_path / "state" / "gpu-usage.sqlite")
    tracker = UsageTracker(usage)
    for minute, gpu in enumerate((reading(BUSY), reading(IDLE), reading(IDLE), reading(IDLE))):
        now = T0 + timedelta(minutes=minute)
        tracker.observe(now, [session("done-1")], snapshot(now, gpu))
    tracker.observe(T0 + timedelta(minutes=5), [], snapshot(T0, reading(IDLE)))
    usage.close()
    command = [sys.executable, "-m", "gpuresa.cli", "--config", str(config_file), "history"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "done-1" in line)
    assert "alice" in line and f"average {BUSY_PERCENT / 4:.0f}%" in line and "4 sample(s)" in line
