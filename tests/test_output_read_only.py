"""Handed-over outputs are read-only to their login, and a login cannot bend the hand-over.

Real host accounts (useradd, removed after), real processes of theirs
(setpriv), a real output root on this machine's disk. The output here is laid
out as a udocker or Slurm session leaves it: the login's own folder at its
final place, which the login's shell may still be working in at the end.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import run_login
from support.waiting import wait_for

import gpuresa.backends.engines  # noqa: F401  (first: outputs.handover alone imports in a cycle)
from gpuresa.access import host_account
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import Session
from gpuresa.outputs.handover import finish_output
from gpuresa.outputs.owners import output_owner, prepare_login_folder, private_group

# what a login's process runs in its output while the hand-over walks it: it renames
# folders, plants hard links and symlinks to files outside, and writes, until told to stop
MISCHIEF = r"""
import os, sys, time
outside, stop, rounds = sys.argv[1], sys.argv[2], sys.argv[3]
number = 0
while not os.path.exists(stop):
    number += 1
    for call in (
        lambda: os.rename("d0", "moved"), lambda: os.rename("moved", "d0"),
        lambda: os.rename("d1/d", "d2/d"), lambda: os.rename("d2/d", "d1/d"),
        lambda: os.link(outside + "/shared-rw", f"d1/hard{number}"),
        lambda: os.link(outside + "/shared-rw", f"hard{number}"),
        lambda: os.symlink(outside + "/shared-rw", f"sym{number}"),
        lambda: os.symlink("/", f"d0/root{number}"),
        lambda: open(f"w{number}", "w").write("x" * 4096),
    ):
        try:
            call()
        except OSError:
            pass
    with open(rounds, "w") as counted:
        counted.write(str(number))
"""


def as_login(login: str, command: list[str], cwd: Path | None = None) -> subprocess.Popen[str]:
    """`command` run as `login` (its uid, primary group and groups), no privileges."""
    return subprocess.Popen(
        ["setpriv", f"--reuid={login}", f"--regid={login}", "--init-groups", *command],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
    )  # fmt: skip


def shell_as(login: str, script: str, cwd: Path | None = None) -> tuple[int, str]:
    process = as_login(login, ["sh", "-c", script], cwd=cwd)
    output, _ = process.communicate(timeout=60)
    return process.returncode, output


@pytest.fixture
def login() -> Iterator[str]:
    """A host account of this test's own, with its private group (useradd's default)."""
    name = run_login("ro")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    yield name
    subprocess.run(["pkill", "-KILL", "-U", name], check=False)
    subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder every user may traverse, on the disk the outputs are on."""
    folder = Path(f"/var/tmp/gpuresa-ro-{uuid.uuid4().hex[:8]}")
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def site(base: Path) -> Config:
    root = base / "output"
    return parse_config({"storage": {"output_root": str(root)}}, str(base / "config.toml"))


def own_output(config: Config, login: str, name: str) -> tuple[Session, Path]:
    """The login's own output folder at its final place (as udocker makes it), with files."""
    account = subprocess.run(["id", "-u", login], capture_output=True, text=True, check=True)
    owner = output_owner(login, config)
    prepare_login_folder(config, owner)
    final = config.storage.output_root / login / name
    final.mkdir(mode=0o750)
    uid = int(account.stdout)
    os.chown(final, uid, owner.gid)
    now = datetime.now(UTC)
    session = Session(
        key=name, user=login, host="h", template="t", cuda=None,
        gpu_count=0, gpu_indices=(), start=now,
        end=now + timedelta(hours=1), ssh_port=0, ftp_port=0, ftp_passive_first=0,
        ftp_passive_last=0, state="stopped", output_dir=final,
    )  # fmt: skip
    return session, final


def tree_entries(top: Path) -> list[tuple[Path, os.stat_result]]:
    found = [(top, top.lstat())]
    for folder, folders, files in os.walk(top):
        for name in folders + files:
            path = Path(folder) / name
            found.append((path, path.lstat()))
    return found


def test_a_handed_over_output_is_readable_and_not_writable_by_its_login(
    base: Path, login: str
) -> None:
    config = site(base)
    session, final = own_output(config, login, "20250101-1000-one")
    # the session writes its results, as the login
    code, output = shell_as(
        login, "mkdir run && echo result > run/log.txt && cp /bin/true run/prog", cwd=final
    )
    assert code == 0, output
    assert finish_output(config, session)
    group = os.stat(final).st_gid
    account = host_account(login)
    assert account is not None and private_group(account) and group == account.gid
    for path, details in tree_entries(final):
        assert (details.st_uid, details.st_gid) == (0, group), path
        expected = 0o750 if stat.S_ISDIR(details.st_mode) or path.name == "prog" else 0o640
        assert stat.S_IMODE(details.st_mode) == expected, path
    # it reads what it made, from its host shell
    code, output = shell_as(login, f"cat {final}/run/log.txt && ls {final}/run")
    assert code == 0 and "result" in output and "prog" in output, output
    # not one byte more, in any way (the cap is final)
    for attempt in (
        f"echo x >> {final}/run/log.txt",
        f"echo x > {final}/new",
        f"touch {final}/run/new",
        f"mkdir {final}/more",
        f"fallocate -l 1M {final}/run/log.txt",
        f"truncate -s 1G {final}/run/log.txt",
        f"rm -f {final}/run/log.txt",
        f"mv {final}/run {final}/gone",
        f"ln {final}/run/log.txt {final}/link",
        f"chmod u+w {final}/run/log.txt",
    ):
        code, output = shell_as(login, attempt)
        assert code != 0, (attempt, output)
    assert (final / "run" / "log.txt").read_text() == "result\n"
    assert sorted(path.name for path in final.iterdir()) == ["run"]


def test_a_login_changing_its_output_during_the_hand_over_changes_nothing_outside(
    base: Path, login: str
) -> None:
    config = site(base)
    session, final = own_output(config, login, "20250101-1100-race")
    outside = base / "outside"
    outside.mkdir(mode=0o755)
    # a root file the login may read and write (so even protected_hardlinks lets it link it)
    shared = outside / "shared-rw"
    shared.write_text("not the output's\n")
    os.chmod(shared, 0o666)
    before = shared.stat()
    code, output = shell_as(
        login,
        "for d in d0 d1 d2; do mkdir -p $d/d/e; for n in $(seq 1 300); do echo $n > $d/d/e/$n; "
        "done; done",
        cwd=final,
    )
    assert code == 0, output
    stop = base / "stop"
    script = base / "mischief.py"
    script.write_text(MISCHIEF)
    os.chmod(script, 0o644)
    # the login's shell works in its output and keeps it as its working folder to the end
    # where it counts its rounds: a root file it may write, outside the tree
    rounds = outside / "rounds"
    rounds.write_text("0")
    os.chmod(rounds, 0o666)

    def rounds_done() -> int:
        return int(rounds.read_text() or 0)  # empty while being rewritten

    command = [sys.executable, str(script), str(outside), str(stop), str(rounds)]
    mischief = as_login(login, command, cwd=final)
    try:
        wait_for(lambda: rounds_done() >= 20, 30, "the login's changes under way")
        assert finish_output(config, session)
        # while it goes on, once more: nothing it does reaches the handed-over tree
        done = rounds_done()
        wait_for(lambda: rounds_done() >= done + 20, 30, "its changes after the hand-over")
    finally:
        stop.touch()
        mischief.communicate(timeout=30)
    after = shared.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert after.st_nlink == 1, "every planted hard link was taken out of the tree"
    assert shared.read_text() == "not the output's\n"
    group = output_owner(login, config).gid
    handed = tree_entries(final)
    assert len(handed) > 900  # the login's files are all there
    for path, details in handed:
        assert (details.st_uid, details.st_gid) == (0, group), path
        assert details.st_ino != before.st_ino or details.st_dev != before.st_dev, path
        assert details.st_mode & 0o7022 == 0 or stat.S_ISLNK(details.st_mode), path
    # nothing is left where only root reaches it, and the login cannot write there
    assert list((config.storage.output_root / ".running-store").iterdir()) == []
    code, output = shell_as(login, f"touch {final}/d1/late")
    assert code != 0, output


def test_a_shared_primary_group_never_reads_another_logins_output(base: Path, login: str) -> None:
    config = site(base)
    # another account with the login's primary group: the group is no longer private
    other = run_login("ro")
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/bin/sh", "--gid", login, other], check=True
    )
    try:
        session, final = own_output(config, login, "20250101-1200-shared")
        code, output = shell_as(login, "echo mine > result", cwd=final)
        assert code == 0, output
        assert finish_output(config, session)
        owner = output_owner(login, config)
        details = (final / "result").stat()
        # the derived group (no host account has it): the output service reads it, not `other`
        assert owner.gid >= config.storage.output_uid_base
        assert (details.st_uid, details.st_gid) == (0, owner.gid)
        code, output = shell_as(other, f"cat {final}/result")
        assert code != 0, output
    finally:
        subprocess.run(["userdel", other], check=False, capture_output=True)
