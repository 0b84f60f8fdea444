"""Small isolation defects, each attacked on the real thing.

- root in a session fills the engine's disk through its container's log
  (Docker and Podman): the log is capped;
- a host user's process named like Podman's conmon is taken for the engine
  holding a session's ports: only root's processes run from root's binary count;
- another host user reads a udocker or Slurm session's folder (its sshd
  config, authorized_keys, logs): the folders are the login's group's alone;
- the sessions' `pids` limits add up past the kernel's pid_max: a warning.

Real host accounts (useradd, removed after), real engines, real Slurm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import BASE_IMAGE, DockerHarness, run_login
from docker.types import Ulimit
from slurm_site import slurm_site
from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    built_fixture,
    make_site,
    site_fixture,
    ssh_login,
)

from gpuresa.backends.engines import processes, stopping
from gpuresa.backends.engines.create_payloads import FTP_PIDS_LIMIT, LOG_MAX_FILES
from gpuresa.backends.udocker.records import Record, Records, write_file
from gpuresa.cli import main
from gpuresa.config.pid_budget import (
    FTP_SIDECAR_PIDS,
    KernelLimits,
    pids_warnings,
    session_capacity,
)
from gpuresa.config.reading import parse_config
from gpuresa.model import SessionSpec

MIB = 1 << 20


@dataclass(frozen=True)
class Account:
    login: str
    uid: int
    gid: int


@contextlib.contextmanager
def host_account() -> Iterator[Account]:
    """A throw-away host account with its own group (removed afterwards)."""
    login = run_login("gsm")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", login], check=True)
    try:
        ids = subprocess.run(["id", "-u", login], capture_output=True, text=True).stdout
        gid = subprocess.run(["id", "-g", login], capture_output=True, text=True).stdout
        yield Account(login, int(ids), int(gid))
    finally:
        subprocess.run(["pkill", "-KILL", "-u", login], check=False)
        subprocess.run(["userdel", login], check=False, capture_output=True)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every host user may traverse (tmp_path's parents are root's alone)."""
    path = Path("/var/tmp") / f"gpuresa-small-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def accounts() -> Iterator[tuple[Account, Account]]:
    """Two host accounts: a session's login and another user."""
    with host_account() as login, host_account() as other:
        yield login, other


def as_account(account: Account, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={account.uid}", f"--regid={account.gid}", "--init-groups",
         "/bin/sh", "-c", command],
        capture_output=True, text=True, timeout=20, cwd="/",
    )  # fmt: skip


# --- the container log ----------------------------------------------------------------------


def log_bytes(site: Site, container: str) -> tuple[int, Path]:
    """The bytes the engine keeps of `container`'s output on its disk (rotated files too)."""
    path = Path(site.client.api.inspect_container(container)["LogPath"])
    files = [path, *path.parent.glob(path.name + ".*")]
    return sum(file.stat().st_size for file in files if file.is_file()), path


def test_root_in_a_session_cannot_fill_the_engines_disk_through_its_log(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    main_container = session.containers[0]
    flood = (
        "sudo -n sh -c 'yes 0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopq"
        " | head -c 100000000 > /proc/1/fd/1' && echo flooded"
    )
    with ssh_login(session, "alice", site.key("alice")) as client:
        _, stdout, stderr = client.exec_command(flood, timeout=240)
        output = stdout.read().decode() + stderr.read().decode()
        code = stdout.channel.recv_exit_status()
    if site.engine == "podman":
        # conmon's pipe is host root's, which the session's root cannot open; what the
        # session's own processes print still goes to the log, capped the same way
        assert code == 0 or "Permission denied" in output, output
        for container in session.containers:
            size_setting = subprocess.run(
                ["podman", "inspect", "--format", "{{.HostConfig.LogConfig.Size}}", container],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            assert size_setting == "10MB", container
    else:
        assert code == 0 and "flooded" in output, output
    # the engine writes what it read a moment later: wait until the size holds still
    size, path = log_bytes(site, main_container)
    for _ in range(40):
        time.sleep(0.25)
        again, _ = log_bytes(site, main_container)
        if again == size:
            break
        size = again
    if site.engine == "docker":
        # the flood went through the log (a log that took nothing would pass too easily)
        assert path.stat().st_size > 1 * MIB
    # the disk kept at most the files of 10 MB (Docker: 2; Podman empties its one)
    assert size <= LOG_MAX_FILES * 10 * MIB + MIB, f"{size} bytes of log in {path.parent}"
    # every container gpuresa makes has the cap, the FTP sidecar's too
    for container in session.containers:
        log_config = site.client.api.inspect_container(container)["HostConfig"]["LogConfig"]
        assert log_config["Type"] in ("json-file", "k8s-file")
        if site.engine == "docker":
            assert log_config["Config"] == {"max-size": "10m", "max-file": "2"}
    runtime.stop(session.key, timedelta(0))


# --- the engine's port keepers --------------------------------------------------------------


IMPOSTOR = (
    "import socket, sys, time\n"
    "open('/proc/self/comm', 'w').write(sys.argv[1])\n"
    "listener = socket.socket()\n"
    "listener.bind(('127.0.0.1', int(sys.argv[2])))\n"
    "listener.listen()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


@contextlib.contextmanager
def impostor(
    account: Account | None, name: str, container: str, port: int
) -> Iterator[subprocess.Popen[str]]:
    """A process named `name`, listening on `port`, whose arguments hold `-c <container>`
    as conmon's do; run by `account` (None: by root, from python's binary)."""
    command = ["/usr/bin/python3", "-c", IMPOSTOR, name, str(port), "-c", container]
    if account is not None:
        command = [
            "setpriv", f"--reuid={account.uid}", f"--regid={account.gid}", "--init-groups",
            *command,
        ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield process
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_host_users_conmon_is_not_taken_for_the_engines(
    podman_harness: DockerHarness, accounts: tuple[Account, Account]
) -> None:
    login, _ = accounts
    # Podman's default limits are more than its runtime may set here (see `engines`)
    limits = [Ulimit(name=name, soft=1024, hard=1024) for name in ("nofile", "nproc")]
    container = podman_harness.run(BASE_IMAGE, ["sleep", "120"], ulimits=limits)
    container_id = str(container.id)
    genuine = processes.port_keepers({container_id})
    # the real one: Podman's conmon for this container, root's, from /usr/bin/conmon
    assert len(genuine) == 1
    with (
        impostor(login, "conmon", container_id, free_local_port()) as user_process,
        impostor(None, "conmon", container_id, free_local_port()) as root_process,
    ):
        assert Path(f"/proc/{user_process.pid}/comm").read_text().strip() == "conmon"
        keepers = processes.port_keepers({container_id})
        # neither the user's (wrong owner) nor root's python named conmon (wrong binary)
        assert keepers == genuine
        assert user_process.pid not in keepers and root_process.pid not in keepers
        assert processes.engine_process(next(iter(genuine)), "conmon")
        assert not processes.engine_process(user_process.pid, "conmon")
        assert not processes.engine_process(root_process.pid, "conmon")


def test_a_host_users_listener_named_like_an_engine_does_not_hold_up_a_removal(
    accounts: tuple[Account, Account],
) -> None:
    login, _ = accounts
    port = free_local_port()
    with impostor(login, "docker-proxy", "none", port):
        programs = processes.listening_programs({port})
        assert programs == {port: {f"docker-proxy (uid {login.uid})"}}
        # a removal does not wait for it: it is not the engine's to let go of
        assert stopping.engine_held([("127.0.0.1", port)]) == []


# --- session folders of the backends that run sessions as their logins ----------------------


def cannot_read(account: Account, path: Path) -> bool:
    return as_account(account, f"cat {path} || ls {path}").returncode != 0


def udocker_record(folder: Path, login: Account) -> Record:
    now = datetime.now(UTC).replace(microsecond=0)
    spec = SessionSpec(
        key="small-udocker@example.org",
        user=login.login,
        host="gpu1",
        template="pytorch",
        cuda=None,
        gpu_count=0,
        gpu_indices=(),
        start=now,
        end=now + timedelta(hours=1),
        ssh_port=2222,
        ftp_port=0,
        ftp_passive_first=0,
        ftp_passive_last=0,
    )
    return Record(spec, login.uid, login.gid, folder / "output", "gpuresa-small")


def test_a_udocker_session_folder_is_the_logins_alone(
    open_dir: Path, accounts: tuple[Account, Account]
) -> None:
    login, other = accounts
    tmp_path = open_dir
    records = Records(tmp_path / "sessions")
    # an older install's modes: opened to everyone
    (tmp_path / "sessions").mkdir(mode=0o755)
    os.chmod(tmp_path / "sessions", 0o755)
    folder = records.write(udocker_record(tmp_path, login))
    # what the daemon writes there: the keys that may log in, the logs of the login's sshd
    write_file(folder / "authorized_keys", "ssh-ed25519 AAAA alice\n")
    write_file(folder / "sshd.log", "Accepted publickey for alice from 10.0.0.7\n")
    details = folder.stat()
    assert (details.st_uid, details.st_gid, details.st_mode & 0o7777) == (0, login.gid, 0o750)
    assert (tmp_path / "sessions").stat().st_mode & 0o7777 == 0o711
    for name in ("record.json", "authorized_keys", "sshd.log"):
        assert cannot_read(other, folder / name), name
        # the login's sshd reads its config and keys by their path
        assert as_account(login, f"cat {folder / name}").returncode == 0, name
    # another user cannot list the sessions to learn their keys
    assert as_account(other, f"ls {tmp_path / 'sessions'}").returncode != 0
    assert records.read("small-udocker@example.org") is not None


def test_a_slurm_session_folder_and_run_are_the_logins_alone(tmp_path: Path) -> None:
    with slurm_site(tmp_path) as cluster:
        backend = cluster.backend()
        later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
        spec = cluster.spec(start=later, end=later + timedelta(hours=1))
        owner, intruder = (
            Account(login, *_ids(login)) for login in (cluster.users[0], cluster.users[1])
        )
        try:
            backend.prepare(spec)
            folder = backend.files.path(spec.key)
            details = folder.stat()
            assert (details.st_uid, details.st_gid) == (0, owner.gid)
            assert details.st_mode & 0o7777 == 0o750
            for name in ("authorized_keys", "banner", "end"):
                assert cannot_read(intruder, folder / name), name
                assert as_account(owner, f"cat {folder / name}").returncode == 0, name
            assert backend.runs.stat().st_mode & 0o7777 == 0o711
            assert as_account(intruder, f"ls {backend.runs}").returncode != 0
        finally:
            backend.stop(spec.key, timedelta(0))


def _ids(login: str) -> tuple[int, int]:
    uid = subprocess.run(["id", "-u", login], capture_output=True, text=True).stdout
    gid = subprocess.run(["id", "-g", login], capture_output=True, text=True).stdout
    return int(uid), int(gid)


# --- the pids budget ------------------------------------------------------------------------


def budget_config(tmp_path: Path, engine: str = "docker", **host: Any) -> Any:
    data = {
        "daemon": {"host": "gpu1", "state_dir": str(tmp_path / "state")},
        "hosts": [{"name": "other"}, {"name": "gpu1", "engine": engine, **host}],
    }
    return parse_config(data, str(tmp_path / "config.toml"))


def test_the_sidecars_pids_are_counted_as_the_runtime_sets_them() -> None:
    assert FTP_SIDECAR_PIDS == FTP_PIDS_LIMIT


@pytest.mark.parametrize(
    ("engine", "host", "kernel", "expected"),
    [
        # the defaults: 32 sessions x (4096 + 128) on a 32768 pid_max
        ("docker", {}, KernelLimits(32768, 192729), "32 sessions of hosts[1]"),
        # threads-max lower than pid_max: it is the one named
        ("podman", {"gpu_mode": "cdi"}, KernelLimits(4194304, 100000), "kernel.threads-max"),
        # udocker sessions have no FTP sidecar: 32 x 4096 only
        ("udocker", {}, KernelLimits(131071, None), "may each take 4096 processes"),
        # four listed GPUs: at most four sessions, 16896 ids, which fit
        ("docker", {"gpus": [0, 1, 2, 3]}, KernelLimits(32768, None), None),
        ("docker", {}, KernelLimits(4194304, 4000000), None),
        # Slurm's sessions run on the cluster's nodes
        ("slurm", {}, KernelLimits(32768, 1000), None),
        # nothing readable: nothing said
        ("docker", {}, KernelLimits(None, None), None),
    ],
)
def test_pids_beyond_the_kernels_process_ids_are_warned_about(
    tmp_path: Path, engine: str, host: dict[str, Any], kernel: KernelLimits, expected: str | None
) -> None:
    warnings = pids_warnings(budget_config(tmp_path, engine, **host), kernel)
    if expected is None:
        assert warnings == []
        return
    (warning,) = warnings
    assert warning.startswith("limits.pids: ") and expected in warning
    assert "sysctl -w kernel." in warning and "lower limits.pids to" in warning


def test_the_warning_gives_a_pids_limit_that_fits(tmp_path: Path) -> None:
    config = budget_config(tmp_path)
    (warning,) = pids_warnings(config, KernelLimits(32768, None))
    assert "135168 in all" in warning and "kernel.pid_max (32768)" in warning
    suggested = int(warning.split("lower limits.pids to ")[1].split()[0])
    sessions = session_capacity(config.host())
    assert sessions * (suggested + FTP_SIDECAR_PIDS) <= 32768
    fitting = replace(config, limits=replace(config.limits, pids=suggested))
    assert pids_warnings(fitting, KernelLimits(32768, None)) == []
    # too many sessions for any useful limit: narrow the ranges instead
    (crowded,) = pids_warnings(config, KernelLimits(2048, None))
    assert "narrow the port ranges" in crowded and "lower limits.pids" not in crowded


def test_config_validate_warns_about_this_machines_pid_max(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    threads_max = int(Path("/proc/sys/kernel/threads-max").read_text())
    # enough sessions at the lowest pids limit to pass this machine's limits
    sessions = min(pid_max, threads_max) // (64 + FTP_SIDECAR_PIDS) + 1
    path = tmp_path / "config.toml"
    (tmp_path / "keys").mkdir()
    (tmp_path / "output").mkdir()
    path.write_text(
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[users]\nkeys_dir = "{tmp_path / "keys"}"\n'
        f'[storage]\noutput_root = "{tmp_path / "output"}"\n'
        "[limits]\npids = 64\n"
        f'[[hosts]]\nname = "gpu1"\ngpus = []\ngpu_mode = "none"\n'
        f'ssh_ports = "300-{299 + sessions}"\nftp_ports = "{300 + sessions}-{299 + 2 * sessions}"\n'
        f'ftp_passive_ports = "30000-{30000 + sessions}"\nftp_passive_per_session = 1\n'
    )
    assert main(["--config", str(path), "config", "validate"]) == 0
    output = capsys.readouterr().out
    assert f"warning: limits.pids: {sessions} sessions of hosts[0]" in output
