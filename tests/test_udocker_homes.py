"""On udocker, the login's home lasts between sessions too, as their own host account's.

Real host accounts, real udocker sessions entered over SSH (see test_udocker).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from support.accounts import as_uid as as_user
from support.accounts import throwaway_account
from test_homes import IMPORT_PACKAGE, INSTALL_PACKAGE
from test_udocker import (  # noqa: F401  (the fixtures this module's tests take)
    Site,
    login_fixture,
    make_fixture,
    site_fixture,
    spec_of,
)

from gpuresa.homes.paths import home_root, image_path, mounted_path, view_path
from gpuresa.homes.store import views

pytestmark = pytest.mark.services
GRACE = timedelta(seconds=1)


@pytest.fixture
def stranger() -> Iterator[int]:
    """Another host account: its uid."""
    with throwaway_account("uds") as uid:
        yield uid


def test_a_udocker_users_home_lasts_and_is_theirs_alone(
    make: Callable[..., Site], stranger: int
) -> None:
    site = make()
    backend = site.backend()
    account = int(subprocess.run(["id", "-u", site.login], capture_output=True,
                                 text=True, check=True).stdout)  # fmt: skip
    first = backend.start(spec_of(site, backend))
    try:
        code, text = site.run(
            first,
            f"echo $HOME; pwd; {INSTALL_PACKAGE} && mkdir -p ~/.local/bin "
            "&& printf 'tool-ok' > ~/.local/bin/tool && ls -A ~",
        )
        assert code == 0, text
        home, where, *listing = text.split()
        assert home == where == f"/home/{site.login}"
        assert ".bashrc" in listing
        # the view is the login's host account's, in a folder of theirs no one else enters
        view = view_path(site.config, site.login, first.key, by_login=True)
        assert os.path.ismount(view)
        assert (view / ".local" / "bin" / "tool").stat().st_uid == account
        # the home itself is its user's alone: the login's group enters the folder of views,
        # not the home (a group shared with others would otherwise read it)
        assert view.stat().st_mode & 0o777 == 0o700
        assert "Permission denied" in as_user(stranger, "ls", str(view))
        # the login enters its folder of views but cannot put a link there, where the next
        # session's view would be mounted (over /etc, say) by root
        assert view.parent.stat().st_uid == 0
        planted = as_user(account, "ln", "-s", "/etc", str(view.parent / "next-session"))
        assert "Permission denied" in planted
        assert "Permission denied" in as_user(stranger, "ls", str(home_root(site.config)))
    finally:
        backend.stop(first.key, GRACE)
    assert views(site.config) == []
    assert not os.path.ismount(mounted_path(site.config, site.login))
    assert image_path(site.config, site.login).exists()
    second = backend.start(spec_of(site, backend))
    try:
        code, text = site.run(second, f"cat ~/.local/bin/tool && echo && {IMPORT_PACKAGE}")
        assert code == 0 and text.split() == ["tool-ok", "installed-before"], text
    finally:
        backend.stop(second.key, GRACE)
    assert not Path(view_path(site.config, site.login, second.key, by_login=True)).exists()
