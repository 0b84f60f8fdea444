"""`udocker run` through gpuresa's launcher, without a terminal (as the bench and sessions run).

The container's output comes back whole and on its own stream, the run exits with
its command's status, and the image's EXPOSE'd port (22) raises no complaint. Real
host account, real udocker and runc (see test_udocker).
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from test_udocker import (  # noqa: F401  (the fixtures this module's tests take)
    Site,
    login_fixture,
    make_fixture,
    site_fixture,
)

from gpuresa.access import host_account
from gpuresa.backends.udocker import tools
from gpuresa.backends.udocker.images import make_container

pytestmark = pytest.mark.services
# more than udocker's own copy loop (a byte at a time from a pty) reads before runc exits
LINES = 20000


def test_a_run_without_a_terminal_gives_the_whole_output_apart_and_the_status(
    site: Site,
) -> None:
    account = host_account(site.login)
    assert account is not None
    backend = site.backend()
    backend.provision("pytorch", None)
    image = backend.images.load("launcher", account, "pytorch", None)
    container = f"gpuresa-launcher-{uuid.uuid4().hex[:8]}"
    make_container(site.config, account, image, container, "launcher")
    script = f"seq 1 {LINES}; echo 'to stderr' >&2; exit 3"
    arguments = ["run", "--nobanner", "--entrypoint=/bin/sh", container, "-c", script]
    result = subprocess.run(
        tools.as_user(account, tools.udocker_command(site.config, arguments)),
        env=tools.environment(site.config, account),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd="/",
        timeout=300,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [str(number) for number in range(1, LINES + 1)], (
        f"{len(result.stdout)} characters, ending {result.stdout[-40:]!r}"
    )
    # nothing of the container's in udocker's stderr, nor a word about the image's EXPOSE 22
    assert result.stderr == "to stderr\n"


def test_a_path_file_in_the_users_own_site_packages_runs_in_nothing_gpuresa_starts(
    site: Site,
) -> None:
    """udocker runs as the login with the site's python3: a `.pth` file in their user
    site-packages would run in every such process (a spare's maker, a removal) and take
    it over. gpuresa's command line says `-s`."""
    account = host_account(site.login)
    assert account is not None
    python = str(site.config.udocker.python)
    version = "import sys; print(*sys.version_info[:2], sep='.')"
    number = subprocess.run([python, "-c", version], capture_output=True, text=True)
    site_packages = account.home / ".local" / "lib" / f"python{number.stdout.strip()}"
    marker = account.home / "taken-over"
    as_login = ["runuser", "-u", site.login, "--"]
    subprocess.run([*as_login, "mkdir", "-p", str(site_packages / "site-packages")], check=True)
    path_file = site_packages / "site-packages" / "evil.pth"
    path_file.write_text(f"import os; open({str(marker)!r}, 'w')\n")
    os.chown(path_file, account.uid, account.gid)
    # the file works for the login's own python3 (the test's control)
    subprocess.run([*as_login, python, "-c", ""], check=True)
    assert marker.exists()
    marker.unlink()
    tools.run_udocker(site.config, account, ["images"], "launcher")
    assert not marker.exists()
