"""udocker sessions against their own login: the host key race, system accounts.

Real host accounts (useradd, removed after) and a real process of the login's
(setpriv) racing gpuresa, as a host shell of that login would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import run_login
from test_udocker import Site
from test_udocker_config import write_config

from gpuresa.access import LOWEST_HOST_UID, host_account
from gpuresa.backends.udocker.records import HOST_KEY, Records
from gpuresa.cli import main
from gpuresa.sessions.errors import SessionError

# the login swaps every public host key it sees for a link to a root file, as fast as it can
SWAPPER = r"""
import glob, os, sys
root, target, stop = sys.argv[1], sys.argv[2], sys.argv[3]
while not os.path.exists(stop):
    for path in glob.glob(root + "/*/ssh/*"):
        try:
            os.unlink(path)
            os.symlink(target, path)
        except OSError:
            pass
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder every user may traverse (as `/var/lib/gpuresa` is)."""
    folder = Path(f"/var/tmp/gpuresa-ud-{uuid.uuid4().hex[:8]}")
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def new_account(*options: str) -> str:
    login = run_login("uh")
    command = ["useradd", "--no-create-home", "--shell", "/bin/sh", *options, login]
    subprocess.run(command, check=True)
    return login


def test_swapping_the_host_key_for_a_link_gives_the_login_no_root_file(base: Path) -> None:
    login = new_account()
    try:
        account = host_account(login)
        assert account is not None
        root = base / "sessions"
        root.mkdir(mode=0o755)
        target = base / "root-secret"
        target.write_text("root's\n")
        os.chmod(target, 0o600)
        stop = base / "stop"
        script = base / "swapper.py"
        script.write_text(SWAPPER)
        os.chmod(script, 0o644)
        swapper = subprocess.Popen(
            ["setpriv", f"--reuid={login}", f"--regid={login}", "--init-groups",
             sys.executable, str(script), str(root), str(target), str(stop)],
        )  # fmt: skip
        records = Records(root)
        try:
            for number in range(40):
                key = f"race-{number}"
                records.folder(key).mkdir(mode=0o755)
                made = records.host_key(key, account)
                # whatever the login swapped, the key gpuresa hands out is a file of the login's
                assert made.name == HOST_KEY
        finally:
            stop.touch()
            swapper.wait(timeout=30)
        details = target.lstat()
        assert (details.st_uid, details.st_gid, details.st_mode & 0o7777) == (0, 0, 0o600)
        assert target.read_text() == "root's\n"
        # and nothing in the sessions' folders outside `ssh` became the login's by a link
        for folder in root.iterdir():
            assert folder.lstat().st_uid == 0
    finally:
        subprocess.run(["userdel", login], check=False, capture_output=True)


def test_a_login_with_a_system_uid_is_refused_with_the_reason(base: Path) -> None:
    login = new_account("--system")
    try:
        account = host_account(login)
        assert account is not None and account.uid < LOWEST_HOST_UID
        site = Site(base / "site", login)
        backend = site.backend()
        spec = backend.new_spec(login, "pytorch", datetime.now(UTC) + timedelta(hours=1))
        with pytest.raises(SessionError, match=rf"system account.*uid {account.uid}, below 1000"):
            backend.account(spec)
    finally:
        subprocess.run(["userdel", login], check=False, capture_output=True)


@pytest.mark.parametrize(
    ("engine", "quota", "warned"),
    [("udocker", None, True), ("udocker", '"2g"', True), ("udocker", '"none"', False),
     ("docker", '"2g"', False)],
)  # fmt: skip
def test_validate_says_a_udocker_host_does_not_keep_the_session_quota(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: str, quota: str | None, warned: bool
) -> None:
    # a udocker login writes its output on the host as itself: an admin who set a cap
    # (or kept the default "auto") must learn it does not hold there
    file = write_config(tmp_path, f'engine = "{engine}"')
    if quota is not None:
        file.write_text(f"{file.read_text()}session_quota = {quota}\n")
    assert main(["config", "validate", "--config", str(file)]) == 0
    out = capsys.readouterr().out
    warning = "warning: storage.session_quota ("
    where = "is not enforced on hosts[0] ('gpu1', engine udocker)"
    if warned:
        assert warning in out and where in out, out
    else:
        assert where not in out, out
