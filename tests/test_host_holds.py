"""What gpuresa holds in the host's kernel: one area mount however many prepare it, and
nothing left when no session needs it (`outputs.running_area`, `backends.engines.host_holds`,
`gpuresa host release`).

Real mounts, loop devices, Docker sessions and daemons; each test removes what it made.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker.types
import pytest
from conftest import BASE_IMAGE, RUN_PREFIX, DockerHarness
from support.waiting import wait_for
from test_daemon_cli import ics_event, write_ics_config
from test_runtime import free_block

from gpuresa.backends.engines import Runtime, host_holds
from gpuresa.backends.engines.host_holds import holdings, release, release_unneeded
from gpuresa.commands import host_commands
from gpuresa.config.reading import load_config, parse_config
from gpuresa.config.sections import Config
from gpuresa.daemon.service import Daemon
from gpuresa.errors import UserError
from gpuresa.outputs.capped import image_path, mount_capped
from gpuresa.outputs.running_area import (
    area,
    area_problem,
    ensure_area,
    mount_points,
    release_area,
    running_path,
    store,
)
from gpuresa.sessions.cgroup_folders import CGROUP_ROOT

CONFTEST = Path(__file__).with_name("conftest.py")


def config_at(root: Path) -> Config:
    return parse_config(
        {
            "storage": {"output_root": str(root / "output"), "session_quota": "32m"},
            "daemon": {"state_dir": str(root)},
        },
        "test.toml",
    )


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below `root`, a point stacked twice listed twice."""
    top = root.resolve()
    return [
        point
        for point in mount_points(Path("/proc/self/mountinfo").read_text())
        if point == top or top in point.parents
    ]


def loops_under(root: Path) -> list[str]:
    devices = json.loads(subprocess.run(["losetup", "-J"], capture_output=True, text=True).stdout
                         or "{}").get("loopdevices", [])  # fmt: skip
    return [
        str(device["name"]) for device in devices
        if str(device.get("back-file") or "").startswith(f"{root.resolve()}/")
    ]  # fmt: skip


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Config]:
    """A config whose output root is in `tmp_path`; whatever stays mounted there is released."""
    config = config_at(tmp_path)
    yield config
    release(config, (), everything=True)
    assert mounts_under(tmp_path) == []
    # a lazily detached loop device is freed once the mount's last user lets go
    wait_for(lambda: loops_under(tmp_path) == [], 30, "the loop devices freed")


# --- one area mount ----------------------------------------------------------------------


def test_eight_sessions_prepared_at_once_make_one_area_mount(config: Config) -> None:
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def prepare() -> None:
        barrier.wait()
        try:
            ensure_area(config)
        except BaseException as error:  # reported below, with the count
            errors.append(error)

    threads = [threading.Thread(target=prepare) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert mounts_under(area(config)) == [area(config).resolve()]
    assert area_problem(area(config)) is None


def test_two_processes_of_four_threads_make_one_area_mount(config: Config, tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import os, threading, time
        from pathlib import Path
        from gpuresa.config.reading import parse_config
        from gpuresa.outputs.running_area import ensure_area
        config = parse_config(
            {{"storage": {{"output_root": "{tmp_path / "output"}"}},
             "daemon": {{"state_dir": "{tmp_path}"}}}},
            "t.toml",
        )
        while not Path("{go}").exists():
            time.sleep(0.001)
        threads = [threading.Thread(target=ensure_area, args=(config,)) for _ in range(4)]
        for thread in threads: thread.start()
        for thread in threads: thread.join()
        """
    )
    processes = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    go.touch()
    assert [process.wait(60) for process in processes] == [0, 0]
    assert mounts_under(area(config)) == [area(config).resolve()]
    assert area_problem(area(config)) is None


def test_an_area_mounted_twice_by_an_older_version_is_not_stacked_again_and_fully_released(
    config: Config,
) -> None:
    ensure_area(config)
    # what the race used to leave: a second bind of the store on the first, without nosuid
    subprocess.run(["mount", "--bind", str(store(config)), str(area(config))], check=True)
    assert area_problem(area(config)) is not None
    ensure_area(config)
    assert len(mounts_under(area(config))) == 2  # repaired in place, not a third on top
    assert area_problem(area(config)) is None
    release_area(config)
    release_area(config)  # gone is done
    assert mounts_under(area(config)) == []


# --- letting go of what no session needs --------------------------------------------------


def capped_pair(config: Config) -> None:
    """Two sessions' running outputs, "a" and "b", each on a 32 MiB image."""
    ensure_area(config)
    for key in ("a", "b"):
        running_path(config, key).mkdir(mode=0o700)
        mount_capped(config, key, running_path(config, key), 32 * 1024**2)


def test_release_keeps_what_a_running_session_needs_and_lets_go_of_the_rest(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    capped_pair(config)
    assert len(loops_under(store(config))) == 2
    caplog.set_level(logging.INFO, "gpuresa.backends.engines.host_holds")
    kept = release_unneeded(config, ["a"])
    assert sorted(str(holding) for holding in kept if holding.kind == "mount") == [
        f"mount {area(config).resolve()}",
        f"mount {running_path(config, 'a').resolve()}",
    ]
    assert mounts_under(running_path(config, "b")) == []
    assert len(loops_under(store(config))) == 1
    # the image keeps what "b" wrote: its hand-over copies it out later
    assert image_path(config, "b").is_file()
    lines = [
        record.getMessage()
        for record in caplog.records
        if "kept on the host" in record.getMessage()
    ]
    assert len(lines) == 1 and "(1 running session(s))" in lines[0]
    assert str(running_path(config, "a").resolve()) in lines[0]

    _, released = release(config, [])
    assert {holding.kind for holding in released} >= {"mount"}
    assert mounts_under(config.daemon.state_dir) == []
    wait_for(lambda: loops_under(store(config)) == [], 30, "the released image's loop freed")
    assert [holding for holding in holdings(config) if holding.kind != "netns"] == []
    assert release(config, [])[0] == []  # gone is done


def test_sessions_that_cannot_be_listed_keep_everything(config: Config) -> None:
    capped_pair(config)
    kept = release_unneeded(config, None)
    assert len(mounts_under(area(config))) == 3
    assert {holding.kind for holding in kept} == {"mount", "loop"}


# --- the daemon and the admin's command ---------------------------------------------------


def gpuresa(config_file: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(config_file), *arguments],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def capped_daemon_config(tmp_path: Path) -> Path:
    config_file = write_ics_config(tmp_path)
    text = config_file.read_text().replace("[storage]\n", '[storage]\nsession_quota = "64m"\n')
    config_file.write_text(text)
    return config_file


def test_a_daemon_stopped_after_its_last_session_ended_leaves_nothing(
    tmp_path: Path, docker_harness: DockerHarness
) -> None:
    config_file = capped_daemon_config(tmp_path)
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0)
    (tmp_path / "calendar" / "a.ics").write_text(
        ics_event("holds-ended", start, start + timedelta(seconds=25), "alice", "gpus: 1")
    )
    runtime = Runtime(config)
    daemon = Daemon(config)
    daemon.start()
    try:
        wait_for(lambda: runtime.list_sessions(), 90, "the session to start")
        assert mounts_under(running_path(config, runtime.list_sessions()[0].key))
        wait_for(lambda: not runtime.list_sessions(), 90, "the session to end")
        wait_for(lambda: not list(store(config).glob("*.json")), 30, "the hand-over")
    finally:
        daemon.shutdown()
    losetup = subprocess.run(["losetup", "-l"], capture_output=True, text=True).stdout
    assert mounts_under(tmp_path) == [], Path("/proc/self/mountinfo").read_text()
    assert loops_under(tmp_path) == [], losetup


def test_a_stopped_daemon_keeps_what_its_session_needs_and_release_all_frees_the_host(
    tmp_path: Path, docker_harness: DockerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    config_file = capped_daemon_config(tmp_path)
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0)
    (tmp_path / "calendar" / "a.ics").write_text(
        ics_event("holds-on", start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )
    runtime = Runtime(config)
    daemon = Daemon(config)
    daemon.start()
    try:
        [session] = wait_for(lambda: runtime.list_sessions(), 90, "the session to start")[:1]
    finally:
        caplog.set_level(logging.INFO, "gpuresa.backends.engines.host_holds")
        daemon.shutdown()
    running = running_path(config, session.key)
    assert mounts_under(area(config)) == [area(config).resolve(), running.resolve()]
    [line] = [
        record.getMessage()
        for record in caplog.records
        if "kept on the host" in record.getMessage()
    ]
    assert str(running.resolve()) in line and "loop" in line
    (running / "result.txt").write_text("kept\n")  # what the session wrote

    released = gpuresa(config_file, "host", "release", "--all")
    assert released.returncode == 0, released.stderr
    assert f"stopped session {session.key}" in released.stdout
    assert runtime.list_sessions() == [] and docker_harness.ours() == []
    assert mounts_under(tmp_path) == [] and loops_under(tmp_path) == []
    assert (session.output_dir / "result.txt").read_text() == "kept\n"  # handed over

    again = gpuresa(config_file, "host", "release", "--all")
    assert again.returncode == 0 and "nothing to release" in again.stdout


def test_host_release_refuses_while_a_daemon_holds_the_state_folder(tmp_path: Path) -> None:
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[storage]\noutput_root = "{tmp_path / "output"}"\n'
    )
    (tmp_path / "state").mkdir()
    with (tmp_path / "state" / "daemon.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused = gpuresa(config_file, "host", "release", "--all")
    assert refused.returncode != 0
    assert "stop it first" in refused.stderr and "Traceback" not in refused.stderr


def test_a_daemon_started_during_a_host_release_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release holds the daemon's lock to its end: a daemon started meanwhile (systemd
    restarting it, an admin) would start sessions again and mount what it unmounts."""
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[storage]\noutput_root = "{tmp_path / "output"}"\n'
    )
    config = load_config(config_file)
    seen: list[str] = []
    real = host_commands.release_host

    def starting_a_daemon_first(*arguments: Any, **options: Any) -> Any:
        daemon = Daemon(config)
        try:
            daemon.start()
        except UserError as error:
            seen.append(str(error))
        else:
            daemon.shutdown()
            seen.append("a daemon started")
        return real(*arguments, **options)

    monkeypatch.setattr(host_commands, "release_host", starting_a_daemon_first)
    arguments = argparse.Namespace(config=config_file, all=True)
    assert host_commands.release_command(arguments) == 0
    [said] = seen
    assert "another gpuresa daemon" in said and "uses" in said
    # and once it is done, a daemon starts
    daemon = Daemon(config)
    daemon.start()
    daemon.shutdown()


# --- the suite's own check of the machine ------------------------------------------------


def write_suite_conftest(suite: Path) -> None:
    """A conftest for a run of `suite` with this suite's check of the machine and nothing else."""
    (suite / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            sys.path.insert(0, {str(CONFTEST.parent)!r})
            spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
            module = importlib.util.module_from_spec(spec)
            sys.modules["suite_conftest"] = module
            spec.loader.exec_module(module)
            pytest_sessionstart = module.pytest_sessionstart
            pytest_sessionfinish = module.pytest_sessionfinish
            """
        )
    )


def run_suite(suite: Path, tmp_path: Path, workers: list[str]) -> subprocess.CompletedProcess[str]:
    """A pytest run of `suite`, a run of its own: its own run prefix (what this run's other
    workers make is not its), and its base folder in `tmp_path` (a numbered one would
    have pytest clean up old runs' folders, and rename what those hold, under this run)."""
    return subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--basetemp", str(tmp_path / "inner-base"), *workers, str(suite),
        ],
        capture_output=True, text=True, timeout=120, cwd=suite,
        env={**os.environ, "GPURESA_TEST_RUN": uuid.uuid4().hex[:6]},
    )  # fmt: skip


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_run_that_leaves_a_mount_fails_and_names_it(tmp_path: Path, workers: list[str]) -> None:
    """A run of one test that mounts a tmpfs and leaves it: the check fails the run (made
    in a worker of pytest-xdist, it is the controller's check that sees it)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    write_suite_conftest(suite)
    # outside pytest's folders, which the inner run would take for another run's
    leak = Path(tempfile.mkdtemp(prefix="gpuresa-leak-", dir="/var/tmp"))
    (suite / "test_leak.py").write_text(
        "import subprocess\n"
        "def test_leaves_a_mount():\n"
        f"    subprocess.run(['mount', '-t', 'tmpfs', 'none', '{leak}'], check=True)\n"
    )
    try:
        result = run_suite(suite, tmp_path, workers)
    finally:
        subprocess.run(["umount", str(leak)], check=False)
        leak.rmdir()
    assert result.returncode == 1, result.stdout
    assert "1 passed" in result.stdout
    assert f"mount: {leak}" in result.stdout


def test_a_run_that_leaves_an_account_or_an_installations_cgroup_fails_naming_them(
    tmp_path: Path,
) -> None:
    """Test accounts and groups (`conftest.run_login`) and udocker sessions' cgroup folders,
    which carry their installation (`<host>@<installation>`), are counted too."""
    suite = tmp_path / "suite"
    suite.mkdir()
    write_suite_conftest(suite)
    made = tmp_path / "made"
    (suite / "test_leak.py").write_text(
        textwrap.dedent(
            f"""
            import pathlib, subprocess
            from suite_conftest import RUN_PREFIX, run_login
            def test_leaves_an_account_and_a_cgroup():
                login = run_login("gleak")
                subprocess.run(["useradd", "--no-create-home", login], check=True)
                folder = f"gpuresa/test-{{RUN_PREFIX}}abcd@{"0" * 24}/session"
                pathlib.Path("/sys/fs/cgroup/pids", folder).mkdir(parents=True)
                pathlib.Path({str(made)!r}).write_text(login + " " + folder)
            """
        )
    )
    try:
        result = run_suite(suite, tmp_path, [])
    finally:
        login, folder = made.read_text().split()
        subprocess.run(["userdel", login], check=False)
        for level in (Path(folder), Path(folder).parent):
            (CGROUP_ROOT / "pids" / level).rmdir()
    assert result.returncode == 1, result.stdout
    assert "1 passed" in result.stdout
    assert f"host account or group: account {login}" in result.stdout
    assert f"host account or group: group {login}" in result.stdout
    assert f"cgroup folder: pids/{folder}" in result.stdout


def test_a_run_that_leaves_nothing_passes_beside_what_the_machine_had(tmp_path: Path) -> None:
    """A mount made before the run and still there after it is not the run's."""
    suite = tmp_path / "suite"
    suite.mkdir()
    write_suite_conftest(suite)
    (suite / "test_clean.py").write_text("def test_nothing():\n    pass\n")
    old = Path(tempfile.mkdtemp(prefix="gpuresa-old-", dir="/var/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "none", str(old)], check=True)
    try:
        result = run_suite(suite, tmp_path, [])
    finally:
        subprocess.run(["umount", str(old)], check=False)
        old.rmdir()
    assert result.returncode == 0, result.stdout


@pytest.fixture
def namespaces(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """Two named network namespaces: one no process is in (an engine's leftover), one a
    process holds (someone's live container); removed afterwards."""
    # both are made now; the age that protects one being set up is not what is tested here
    monkeypatch.setattr(host_holds, "NETNS_MIN_AGE", 0.0)
    names = (f"netns-{uuid.uuid4()}", f"netns-{uuid.uuid4()}")  # named as Podman names them
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    holder = subprocess.Popen(["ip", "netns", "exec", names[1], "sleep", "300"])
    try:
        wait_for(lambda: _inside(names[1]), 10, "the process in its namespace")
        yield names
    finally:
        holder.kill()
        holder.wait()
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)


def _inside(name: str) -> bool:
    target = (host_holds.NETNS_FOLDER / name).stat().st_ino
    return target in host_holds._namespaces_in_use()


@pytest.fixture
def held_podman_exit(
    podman_client: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, int, int]]:
    """A Podman container with a published port whose process has just ended, its conmon
    held (SIGSTOP) before Podman's own clean-up; let go of (SIGCONT) and removed afterwards.
    Yields (its namespace's name, the port, conmon's pid)."""
    monkeypatch.setattr(host_holds, "NETNS_MIN_AGE", 0.0)
    port = free_block(1)
    container = podman_client.containers.create(
        BASE_IMAGE, ["sleep", "300"], labels={"gpuresa.test-run": RUN_PREFIX},
        ports={"22/tcp": ("127.0.0.1", port)},
        # the service's own limits are below those the engine would ask (as for sessions)
        ulimits=[
            docker.types.Ulimit(name=name, soft=1024, hard=1024) for name in ("nofile", "nproc")
        ],
    )  # fmt: skip
    conmon = 0
    try:
        container.start()
        container.reload()
        pid = int(container.attrs["State"]["Pid"])
        namespace = Path(container.attrs["NetworkSettings"]["SandboxKey"]).name
        found = subprocess.run(
            ["pgrep", "-o", "-f", f"conmon .*-c {container.id}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        conmon = int(found.stdout)
        os.kill(conmon, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        # conmon, held, reaps nothing: the process stays a zombie, in no namespace
        wait_for(lambda: ended(pid), 10, "the container's process to end")
        yield namespace, port, conmon
    finally:
        if conmon:
            with contextlib.suppress(ProcessLookupError):
                os.kill(conmon, signal.SIGCONT)
        container.remove(force=True)


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def forwarding_rules(port: int) -> list[str]:
    text = subprocess.run(
        ["iptables-save", "-t", "nat"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in text.splitlines() if f"--dport {port} " in line]


def test_the_namespace_of_a_container_podman_still_has_is_no_leftover(
    config: Config, held_podman_exit: tuple[str, int, int]
) -> None:
    """Its process gone, its clean-up (which tears its port forwarding down through the
    namespace) not run yet: released then, Podman could not tear the forwarding down, and a
    rule would send the port to an address nobody has."""
    namespace, port, conmon = held_podman_exit
    assert forwarding_rules(port)
    assert namespace not in [holding.what for holding in holdings(config)]
    _, released = release(config, [], everything=True)
    assert f"netns {namespace}" not in map(str, released)
    assert (host_holds.NETNS_FOLDER / namespace).exists()
    # Podman's clean-up then runs whole, and takes the forwarding with it
    os.kill(conmon, signal.SIGCONT)
    wait_for(lambda: not forwarding_rules(port), 30, "Podman's clean-up of the forwarding")
    wait_for(lambda: not (host_holds.NETNS_FOLDER / namespace).exists(), 30, "its namespace to go")


def test_a_namespace_no_process_is_in_is_released_and_a_live_one_never(
    config: Config, namespaces: tuple[str, str]
) -> None:
    left, live = namespaces
    admins = f"admin-{uuid.uuid4().hex[:8]}"  # an admin's own, empty: not Podman's
    subprocess.run(["ip", "netns", "add", admins], check=True)
    try:
        _, released = release(config, [], everything=True)
        assert (host_holds.NETNS_FOLDER / admins).exists()
    finally:
        subprocess.run(["ip", "netns", "delete", admins], check=False)
    assert f"netns {left}" in map(str, released)
    assert f"netns {live}" not in map(str, released)
    assert not (host_holds.NETNS_FOLDER / left).exists()
    assert (host_holds.NETNS_FOLDER / live).exists()


def test_the_check_counts_its_own_folders_and_not_another_runs_or_their_garbage() -> None:
    """Another run's base folder, and one pytest's clean-up renamed on its way out (which
    moves the mounts left in it), are not this run's; its own and other temporary ones are."""
    from support.machine import mounts

    base = Path("/tmp/pytest-of-root/pytest-7")
    points = [
        f"{base}/popen-gw0/test_a0/output/.running",
        "/tmp/pytest-of-root/pytest-6/popen-gw1/test_b0/output/.running",
        "/tmp/pytest-of-root/garbage-93867da4-5978-4628-a7b7-f380b34da82c/popen-gw0/x.copy",
        "/var/tmp/gpuresa-leak-1",
        "/home/alice/mine",
    ]
    mountinfo = "".join(
        f"{index} 1 0:{index} / {point} rw shared:1 - tmpfs none rw\n"
        for index, point in enumerate(points, start=30)
    )
    assert mounts(base, mountinfo) == {points[0], points[3]}
