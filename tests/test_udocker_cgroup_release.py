"""The cgroup folders of udocker sessions leave with the sessions (`udocker.cgroups`,
`sessions.cgroup_folders`, `backends.engines.host_holds`): a host's folder goes with
its last session, one left by a session that never ended cleanly goes at the
daemon's stop or with `gpuresa host release`, and one a process is in stays.

Real cgroup folders under /sys/fs/cgroup, for host names of this test run (the
suite's check of the machine counts any left).
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RUN_PREFIX
from support.waiting import wait_for

from gpuresa.backends.engines.host_holds import holdings, release
from gpuresa.backends.engines.identity import installation_label
from gpuresa.backends.udocker.backend import UdockerBackend
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.sessions import cgroup_folders as cgroups
from gpuresa.sessions.cgroup_folders import CGROUP_ROOT
from gpuresa.sessions.labels import safe_key
from gpuresa.sessions.limits import SessionLimits

LIMITS = SessionLimits(cpus=1.0, memory=256 << 20)


@pytest.fixture
def host() -> Iterator[str]:
    """A host name of this run that no other test uses; its folders are removed after."""
    name = f"test-{RUN_PREFIX}{uuid.uuid4().hex[:4]}"
    yield name
    for folder in host_folders(name):
        for entry in folder.iterdir():
            if entry.is_dir():
                entry.rmdir()
        folder.rmdir()


def host_folders(host: str) -> list[Path]:
    """Every folder of `host`'s sessions, of any installation (and of none: `gpuresa/<host>`,
    where sessions started before their folder carried their installation)."""
    return [
        folder
        for controller in (*cgroups.CONTROLLERS, *cgroups.OPTIONAL)
        for folder in sorted((CGROUP_ROOT / controller / "gpuresa").glob(f"{host}*"))
        if folder.name == host or folder.name.startswith(f"{host}@")
    ]


def base_of(host: str, state_dir: Path) -> Path:
    """The folder of the sessions of the installation whose state is in `state_dir`."""
    return cgroups.host_folder(host, installation_label(state_dir))


def config_for(host: str, root: Path, engine: str = "udocker") -> Config:
    return parse_config(
        {
            "daemon": {"host": host, "state_dir": str(root / "state")},
            "hosts": [{"name": host, "engine": engine}],
            "storage": {"output_root": str(root / "output")},
        },
        "test.toml",
    )


def test_the_last_session_takes_its_hosts_folder_with_it(host: str, tmp_path: Path) -> None:
    base = base_of(host, tmp_path)
    first, second = SessionCgroup(base, "first"), SessionCgroup(base, "second")
    first.create(LIMITS, 64)
    second.create(LIMITS, 64)
    assert len(host_folders(host)) >= 4
    first.remove()
    assert not first.exists()
    assert len(host_folders(host)) >= 4, "the host's folder went while a session was in it"
    second.remove()
    assert host_folders(host) == []


def test_folders_are_roots_and_closed_to_others_whatever_the_umask(
    host: str, tmp_path: Path
) -> None:
    """A host user who could write in the host's folder could make a session's folder of
    their own there before gpuresa does, and own that session's limits."""
    cgroup = SessionCgroup(base_of(host, tmp_path), "lax")
    before = os.umask(0)
    try:
        cgroup.create(LIMITS, 64)
    finally:
        os.umask(before)
    try:
        for folder in host_folders(host):
            for made in (folder, folder / "lax"):
                details = made.stat()
                assert (details.st_uid, stat.S_IMODE(details.st_mode)) == (0, 0o755), made
    finally:
        cgroup.remove()


def test_a_session_made_as_another_ends_is_made_whole(host: str, tmp_path: Path) -> None:
    """One session made while another of the host ends, again and again: the ending one
    removes the host's folder between the making one's two mkdirs, which it makes again."""
    problems: list[str] = []
    base = base_of(host, tmp_path)

    def churn(name: str) -> None:
        for index in range(150):
            cgroup = SessionCgroup(base, f"{name}-{index}")
            try:
                cgroup.create(LIMITS, 64)
                assert cgroup.exists()
            except Exception as error:  # every failure is the test's finding
                problems.append(f"{name}-{index}: {error}")
            finally:
                cgroup.remove()

    workers = [threading.Thread(target=churn, args=(name,)) for name in ("a", "b", "c")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert problems == []
    assert host_folders(host) == []


def test_release_removes_what_no_session_needs_and_keeps_what_a_process_is_in(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon's stop (`release` with the running sessions' keys), then `host release --all`."""
    config = config_for(host, tmp_path)
    base = base_of(host, config.daemon.state_dir)
    # named as the udocker backend names them: by the session's safe key
    ended, running, busy = (
        SessionCgroup(base, safe_key(f"{name}@gpu1")) for name in ("ended", "running", "busy")
    )
    for cgroup in (ended, running, busy):
        cgroup.create(LIMITS, 64)
    # a process in "busy" (a session the daemon does not list: never killed by a release)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for procs in busy.procs_files():
            procs.write_text(str(sleeper.pid))
        kept, released = release(config, ["running@gpu1"])
        names = {str(holding): holding for holding in kept + released}
        assert f"cgroup {ended.relative}" in map(str, released)
        assert f"cgroup {running.relative}" in map(str, kept)
        assert names[f"cgroup {busy.relative}"].in_use
        assert f"cgroup {busy.relative}" in map(str, kept)
        assert f"cgroup {base}" in map(str, kept)
        assert not ended.exists() and running.exists() and busy.exists()

        with caplog.at_level(logging.WARNING):
            kept, released = release(config, [], everything=True)
        # the host's folder is kept for the session's in it, not tried and found busy
        assert not [record for record in caplog.records if "cannot release" in record.message]
        assert f"cgroup {running.relative}" in map(str, released)
        assert {str(holding) for holding in kept if holding.kind == "cgroup"} == {
            f"cgroup {busy.relative}",
            f"cgroup {base}",
        }
        assert sleeper.poll() is None, "a release killed a process"
        # another installation's daemon on this machine, of the same host name on Docker,
        # lists none of them
        docker = config_for(host, tmp_path, engine="docker")
        assert not [holding for holding in holdings(docker) if holding.kind == "cgroup"]
    finally:
        sleeper.kill()
        sleeper.wait()
    # its process gone, the folder left as a daemon killed mid-stop leaves it: the next
    # daemon's stop removes it, then the host's folder
    wait_for(lambda: not busy.members(), timeout=10, what="the killed process to leave")
    kept, released = release(config, [])
    assert [str(holding) for holding in released if holding.kind == "cgroup"] == [
        f"cgroup {busy.relative}",
        f"cgroup {base}",
    ]
    assert not [holding for holding in kept if holding.kind == "cgroup"]
    assert host_folders(host) == []


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def test_two_installations_of_one_host_name_never_take_each_others_cgroups(
    host: str, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """A test daemon beside the real one, both `gpu1`, with a session of the same key: the
    second's clean-up (each round, and at its stop) leaves the first's session running."""
    first = UdockerBackend(config_for(host, tmp_path / "first"))
    second = UdockerBackend(config_for(host, tmp_path / "second"))
    key = f"same@{host}"
    mine, theirs = first.cgroup(key), second.cgroup(key)
    assert mine.relative != theirs.relative
    for cgroup in (mine, theirs):
        cgroup.create(LIMITS, 64)
    for procs in mine.procs_files():
        procs.write_text(str(sleeper.pid))

    # the second has no record of a session: what it finds of its own goes
    assert second.cleanup(set()) == [f"cgroup {safe_key(key)}"]
    assert not theirs.exists()
    assert sleeper.poll() is None, "a clean-up killed another installation's session"
    assert mine.members() == [sleeper.pid]
    release(second.config, [], everything=True)
    assert [holding for holding in holdings(second.config) if holding.kind == "cgroup"] == []
    assert mine.exists() and sleeper.poll() is None
    # the first lists it as its own
    assert f"cgroup {mine.relative}" in {str(holding) for holding in holdings(first.config)}
    sleeper.kill()
    wait_for(lambda: not mine.members(), timeout=10, what="the killed process to leave")
    mine.remove()


def test_a_session_started_before_its_folder_named_its_installation_is_found_again(
    host: str, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """A daemon upgraded while a udocker session runs finds it where it started,
    `gpuresa/<host>/<key>`, by the first process it recorded there; the same key's folder
    there with another process in it (another installation's) is never taken."""
    backend = UdockerBackend(config_for(host, tmp_path))
    key = f"upgraded@{host}"
    earlier = SessionCgroup(Path("gpuresa") / host, safe_key(key))
    earlier.create(LIMITS, 64)
    for procs in earlier.procs_files():
        procs.write_text(str(sleeper.pid))
    recorded = backend.records.folder(key) / "container.pid"
    recorded.parent.mkdir(parents=True)

    recorded.write_text(f"{os.getpid()}\n")  # not in that folder: another's session
    assert backend.cgroup(key).relative == base_of(host, backend.config.daemon.state_dir) / (
        safe_key(key)
    )
    assert backend.cleanup(set()) == []
    assert earlier.members() == [sleeper.pid]

    recorded.write_text(f"{sleeper.pid}\n")
    found = backend.cgroup(key)
    assert found.relative == earlier.relative
    # its end kills it there, and takes the old host folder with its last session
    found.kill_all()
    found.remove()
    assert sleeper.wait(timeout=10) == -9
    assert host_folders(host) == []
