"""No session's output gives anyone another identity on the host, or reaches anyone during it.

The attack, on Docker with `userns-remap`: root of a session copies a shell
into its output, makes it set-uid and opens the folder; a host user then runs
it and is the shared uid that is root in every Docker session. Each defence is
tested on its own (the others switched off by the test), and a control run
shows the attack works when none is there, so these tests can fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import run_login
from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    built_fixture,
    make_site,
    run,
    running_output,
    site_fixture,
    ssh_login,
)

from gpuresa.outputs.handover import retry_pending
from gpuresa.outputs.records import folder_bytes
from gpuresa.outputs.running_area import area, area_problem, ensure_area, release_area, store
from gpuresa.outputs.tree import CAPABILITY_XATTR, hand_tree, remove_tree

SHARED_ROOT = 100000  # host uid of root in every Docker session (userns-remap)


@pytest.fixture
def host_user() -> Iterator[tuple[str, int]]:
    """A throw-away host account (removed afterwards): (login, uid)."""
    login = run_login("giso")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", login], check=True)
    try:
        uid = int(subprocess.run(["id", "-u", login], capture_output=True, text=True).stdout)
        yield login, uid
    finally:
        subprocess.run(["userdel", login], check=False)


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A folder every host account can traverse (pytest's own are root-only), on a
    filesystem without nosuid: where an unprotected output would be."""
    root = Path(tempfile.mkdtemp(prefix="gpuresa-iso-", dir="/var/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4]
            if point.startswith(str(root)):
                subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(root, ignore_errors=True)


def as_user(uid: int, *command: str) -> subprocess.CompletedProcess[str]:
    """Run `command` as host uid `uid` (no groups, no privileges)."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command],
        capture_output=True,
        text=True,
        timeout=20,
    )


def plant_shell(folder: Path) -> Path:
    """What the session's root does: a set-uid, set-gid copy of bash, owned by the shared uid."""
    shell = folder / ".rb"
    shutil.copy("/bin/bash", shell)
    os.chown(shell, SHARED_ROOT, SHARED_ROOT)
    os.chmod(shell, 0o6755)
    return shell


def euid_through(shell: Path, uid: int) -> str:
    """The euid a host user gets from `shell -p` (or why it cannot be run).

    Through a shell of the user's: setpriv still holds root's capabilities
    while it executes its own command, which would reach any folder.
    """
    result = as_user(uid, "/bin/sh", "-c", '"$0" -p -c "id -u"', str(shell))
    return (result.stdout + result.stderr).strip()


def config_at(root: Path) -> Site:
    from gpuresa.config.reading import parse_config

    config = parse_config(
        {"storage": {"output_root": str(root / "output")}, "daemon": {"state_dir": str(root)}},
        "test.toml",
    )
    return Site(root, config, None)


def test_a_set_uid_shell_in_an_output_gives_a_host_user_nothing(
    open_root: Path, host_user: tuple[str, int]
) -> None:
    _, uid = host_user
    # control: with no defence, the attack gives the shared uid (the test can fail)
    exposed = open_root / "exposed"
    exposed.mkdir(mode=0o755)
    assert euid_through(plant_shell(exposed), uid) == str(SHARED_ROOT)

    site = config_at(open_root)
    running = ensure_area(site.config)
    assert area_problem(running) is None
    output = running / "session"
    output.mkdir()
    os.chown(output, SHARED_ROOT, SHARED_ROOT)
    shell = plant_shell(output)
    output.chmod(0o755)  # "the session's root opened the rest"

    # defence 1: the running area is root's alone
    assert "Permission denied" in euid_through(shell, uid)

    # defence 2 alone (the test opens the area): nosuid, the shell runs as the user
    running.chmod(0o755)
    assert euid_through(shell, uid) == str(uid)
    running.chmod(0o700)

    # defence 3 alone (a set-uid file where suid works): the hand-over clears the bits
    leftover = plant_shell(exposed)
    os.setxattr(leftover, CAPABILITY_XATTR, struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0))
    hand_tree(exposed, uid, uid)
    details = leftover.lstat()
    assert details.st_mode & 0o6000 == 0 and details.st_uid == uid
    assert CAPABILITY_XATTR not in os.listxattr(leftover)
    assert euid_through(leftover, uid) == str(uid)


def test_the_running_area_is_repaired_before_use(open_root: Path) -> None:
    site = config_at(open_root)
    running = ensure_area(site.config)
    release_area(site.config)  # a host reboot drops the mount
    running.chmod(0o755)  # and an admin opened it
    assert area_problem(running) is not None
    ensure_area(site.config)
    assert area_problem(running) is None


def _deep_chain(top: Path, depth: int) -> None:
    """`depth` nested folders below `top`, made through descriptors (past PATH_MAX)."""
    current = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=current)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=current)
            os.close(current)
            current = child
        fd = os.open("deepest", os.O_WRONLY | os.O_CREAT, 0o6755, dir_fd=current)
        os.write(fd, b"x" * 4096)
        os.close(fd)
        os.chmod("deepest", 0o6755, dir_fd=current)
    finally:
        os.close(current)


def _deepest(top: Path, depth: int) -> os.stat_result:
    current = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=current)
            os.close(current)
            current = child
        return os.stat("deepest", dir_fd=current, follow_symlinks=False)
    finally:
        os.close(current)


def test_a_tree_ten_thousand_levels_deep_is_handed_over_measured_and_removed(
    tmp_path: Path,
) -> None:
    top = tmp_path / "deep"
    top.mkdir()
    _deep_chain(top, 10_000)
    assert hand_tree(top, 4242, 4343) == 10_002
    deepest = _deepest(top, 10_000)
    assert (deepest.st_uid, deepest.st_gid) == (4242, 4343)
    assert deepest.st_mode & 0o6000 == 0
    assert folder_bytes(top) >= 4096
    remove_tree(top)
    assert not top.exists()


def test_one_hand_over_of_many_files_never_follows_a_link(tmp_path: Path) -> None:
    top = tmp_path / "many"
    top.mkdir()
    for index in range(20):
        folder = top / f"f{index}"
        folder.mkdir()
        for number in range(500):
            (folder / str(number)).touch()
    (top / "to-passwd").symlink_to("/etc/passwd")
    (top / "to-etc").symlink_to("/etc")
    before = os.stat("/etc/passwd")
    assert hand_tree(top, 4242, 4242) == 20 * 500 + 20 + 2 + 1
    assert os.stat("/etc/passwd").st_uid == before.st_uid
    assert (top / "to-etc").lstat().st_uid == 4242
    assert (top / "f19" / "499").stat().st_uid == 4242


def test_a_failed_hand_over_stays_root_only_and_is_retried(tmp_path: Path) -> None:
    site = config_at(tmp_path)
    ensure_area(site.config)
    from gpuresa.outputs.running_area import remember, running_path

    final = tmp_path / "output" / "alice" / "out"
    remember(site.config, "k1", "alice", final)
    folder = running_path(site.config, "k1")
    folder.mkdir()
    (folder / "result").write_text("r\n")
    reports: list[tuple[str, str]] = []
    # the owner cannot be set up: the login folder is a file
    (tmp_path / "output" / "alice").write_text("")
    assert retry_pending(site.config, set(), lambda key, why: reports.append((key, why))) == 0
    assert reports and reports[0][0] == "k1" and folder.is_dir()
    assert stat.S_IMODE(store(site.config).stat().st_mode) == 0o700
    (tmp_path / "output" / "alice").unlink()
    # a live session's output is never touched; once gone, the retry finishes it
    assert retry_pending(site.config, {"k1"}, lambda key, why: None) == 0
    assert retry_pending(site.config, set(), lambda key, why: None) == 1
    assert (final / "result").read_text() == "r\n" and not folder.exists()


def test_the_attack_through_a_real_session_is_stopped(
    site: Site, open_root: Path, host_user: tuple[str, int]
) -> None:
    """The attack step by step on each engine, from a session to a host account."""
    _, uid = host_user
    site = make_site(open_root / "site", site.client, engine=site.engine)
    for parent in (open_root / "site", open_root / "site" / "output"):
        parent.chmod(0o755)
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    try:
        with ssh_login(session, "alice", site.key("alice")) as client:
            # step 1, in the session (a sudoer there)
            code, output = run(
                client,
                "sudo -n cp /bin/bash /output/.rb && sudo -n chmod 6755 /output/.rb "
                "&& sudo -n chmod 755 /output && grep ' /output ' /proc/self/mountinfo",
            )
            assert code == 0, output
            # the output is nosuid and nodev in the session itself
            options = output.split()[5].split(",")
            assert "nosuid" in options and "nodev" in options, output
            code, output = run(client, "/output/.rb -p -c 'id -u'")
            assert output.strip() != "0"
        running = running_output(site, session)
        shell = running / ".rb"
        assert shell.lstat().st_mode & 0o6000 == 0o6000
        # step 2, on the host: the running output is out of reach
        assert "Permission denied" in euid_through(shell, uid)
        # and with the area opened by the test: nosuid, no other identity
        area(site.config).chmod(0o755)
        assert euid_through(shell, uid) == str(uid)
        area(site.config).chmod(0o700)
    finally:
        runtime.stop(session.key, timedelta(seconds=1))
    # step 4: the hand-over cleared the bits and moved the output to its place
    handed = session.output_dir / ".rb"
    assert handed.lstat().st_mode & 0o6000 == 0
    with contextlib.suppress(FileNotFoundError):
        assert not running_output(site, session).exists()
