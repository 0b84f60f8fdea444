"""Each user's home lasts from one session to the next, and is theirs alone.

Real sessions on Docker and Podman (the user logs in with SSH), real host
accounts, a real image per home. What a session leaves in its home (a tool,
root's file, a set-uid shell), who else can reach it (another user's session,
a host account), its cap, two sessions of one user at once, and what a gone
session leaves.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from support.accounts import as_uid as as_user
from support.accounts import throwaway_account
from support.logins import run
from test_homes_safety import DOCKER_RANGE, config_at, open_root  # noqa: F401  (a fixture)
from test_runtime import (  # noqa: F401  (the fixtures this module's tests take)
    Site,
    built_fixture,
    docker_site,
    images,
    make_site,
    site_fixture,
    ssh_login,
)

from gpuresa.homes.paths import home_root, homes_area, image_path, mounted_path, view_path
from gpuresa.homes.store import attach, home_maps, reserve_view, views
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

GRACE = timedelta(seconds=1)
# a package where `pip install --user` puts one, and its import in a later session
INSTALL_PACKAGE = (
    'site=$(python3 -c "import site; print(site.getusersitepackages())") '
    '&& mkdir -p "$site/lasting" '
    '&& echo \'WHEN = "installed-before"\' > "$site/lasting/__init__.py"'
)
IMPORT_PACKAGE = "python3 -c 'import lasting; print(lasting.WHEN)'"


@pytest.fixture
def host_user() -> Iterator[int]:
    """A throw-away host account: its uid."""
    with throwaway_account("ghome") as uid:
        yield uid


def euid_through(shell: Path, uid: int) -> str:
    """The euid a host user gets from `shell -p` (or why it cannot be run), through a shell
    of theirs: setpriv holds root's capabilities while it executes its own command."""
    return as_user(uid, "/bin/sh", "-c", '"$0" -p -c "id -u"', str(shell))


def in_session(site: Site, session: object, login: str, command: str) -> str:
    """`command`'s output in `session` as `login`, which must succeed."""
    with ssh_login(session, login, site.key(login)) as client:  # type: ignore[arg-type]
        code, output = run(client, command)
    assert code == 0, output
    return output


def test_what_a_user_installs_is_there_in_their_next_session_with_its_owners(
    site: Site,
) -> None:
    runtime = site.runtime()
    first = runtime.start(site.spec(runtime, "alice"))
    try:
        output = in_session(
            site,
            first,
            "alice",
            # what `pip install --user` leaves: a package in the user's site folder
            f"{INSTALL_PACKAGE} && mkdir -p ~/.local/bin "
            "&& printf '#!/bin/sh\\necho tool-ok\\n' > ~/.local/bin/tool "
            "&& chmod +x ~/.local/bin/tool && sudo -n touch ~/made-by-root && echo $HOME "
            "&& id -u && ls -a ~",
        )
        home, uid, *listing = output.split()
        assert home == "/home/alice"
        # a new home has the shell's start files, and no lost+found in the user's way
        assert ".bashrc" in listing and "lost+found" not in listing
    finally:
        runtime.stop(first.key, GRACE)
    # the last session of the user gone: the home is no longer mounted anywhere
    assert not os.path.ismount(mounted_path(site.config, "alice"))
    assert views(site.config) == []
    second = runtime.start(site.spec(runtime, "alice"))
    try:
        output = in_session(
            site, second, "alice", "~/.local/bin/tool && stat -c '%u %U' ~/.local/bin/tool "
            f"~/made-by-root && touch ~/again && {IMPORT_PACKAGE}"
        )  # fmt: skip
        assert output.split() == ["tool-ok", uid, "alice", "0", "root", "installed-before"]
    finally:
        runtime.stop(second.key, GRACE)


def test_two_sessions_of_a_user_share_the_home_and_another_users_session_has_none_of_it(
    site: Site,
) -> None:
    runtime = site.runtime()
    sessions = [runtime.start(site.spec(runtime, login)) for login in ("alice", "alice", "bob")]
    first, second, bobs = sessions
    try:
        assert first.id_range is not None and second.id_range is not None
        if site.engine == "podman":
            # each session its own host ids: the same home shows its files as each one's own
            assert first.id_range != second.id_range
        in_session(site, first, "alice", "echo from-the-first > ~/shared.txt")
        output = in_session(site, second, "alice", "cat ~/shared.txt && stat -c %U ~/shared.txt")
        assert output.split() == ["from-the-first", "alice"]
        # bob's session has bob's home alone: alice's is mounted nowhere in it
        output = in_session(
            site, bobs, "bob", "ls -A /home/alice | wc -l; echo $HOME; cat /proc/self/mountinfo"
        )
        count, home, *mounts = output.split("\n")
        assert count.strip() == "0" and home == "/home/bob"
        assert sum(" /home/" in line for line in mounts) == 1
        runtime.stop(first.key, GRACE)
        # the other session of alice still runs: her home stays mounted for it
        assert os.path.ismount(mounted_path(site.config, "alice"))
        assert in_session(site, second, "alice", "cat ~/shared.txt").strip() == "from-the-first"
    finally:
        for session in sessions:
            runtime.stop(session.key, GRACE)
    assert not os.path.ismount(mounted_path(site.config, "alice"))
    assert not os.path.ismount(mounted_path(site.config, "bob"))


def test_a_host_account_reaches_no_home_and_a_set_uid_file_there_gives_nothing(
    docker_site: Site,  # noqa: F811  (the fixture imported above)
    open_root: Path,  # noqa: F811  (the fixture imported above)
    host_user: int,
) -> None:
    site = make_site(open_root / "site", docker_site.client)
    for folder in (open_root / "site", open_root / "site" / "state"):
        folder.chmod(0o755)
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    try:
        # the session's root plants a set-uid shell in the home, open to all
        in_session(
            site, session, "alice",
            "sudo -n cp /bin/bash ~/.rb && sudo -n chmod 6755 ~/.rb && chmod 755 ~",
        )  # fmt: skip
        view = view_path(site.config, "alice", session.key)
        shell = mounted_path(site.config, "alice") / ".rb"
        assert (view / ".rb").lstat().st_mode & 0o6000 == 0o6000
        # layer 1: the mounted homes, their views and the images are root's alone
        for path in (shell, view / ".rb", image_path(site.config, "alice")):
            assert "Permission denied" in as_user(host_user, "cat", str(path))
        assert "Permission denied" in euid_through(shell, host_user)
        # layer 2 alone (the test opens the area): nosuid, the shell runs as the user
        homes_area(site.config).chmod(0o755)
        (homes_area(site.config) / "mounted").chmod(0o755)
        try:
            assert euid_through(shell, host_user) == str(host_user)
        finally:
            homes_area(site.config).chmod(0o700)
            (homes_area(site.config) / "mounted").chmod(0o700)
        # and in the session itself: the home is nosuid for its own user
        with ssh_login(session, "alice", site.key("alice")) as client:
            _, output = run(client, "~/.rb -p -c 'id -u'")
        assert output.strip() != "0"
    finally:
        runtime.stop(session.key, GRACE)


def test_a_full_home_refuses_its_user_alone(
    docker_site: Site,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    site = make_site(tmp_path / "site", docker_site.client, storage={"home_quota": "64M"})
    runtime = site.runtime()
    alices = runtime.start(site.spec(runtime, "alice"))
    bobs = runtime.start(site.spec(runtime, "bob"))
    try:
        with ssh_login(alices, "alice", site.key("alice")) as client:
            _, output = run(client, "dd if=/dev/zero of=~/big bs=1M count=100 2>&1; echo done")
            assert "No space left on device" in output
            # the rest of her session writes on: only the home is full
            code, output = run(client, "echo kept > /output/result.txt && cat /output/result.txt")
            assert code == 0 and output.strip() == "kept"
        assert in_session(site, bobs, "bob", "echo fine > ~/x && cat ~/x").strip() == "fine"
    finally:
        runtime.stop(alices.key, GRACE)
        runtime.stop(bobs.key, GRACE)
    # the image holds what was written, never more than its cap
    assert image_path(site.config, "alice").stat().st_blocks * 512 <= 64 << 20


def test_the_view_of_a_session_gone_behind_gpuresas_back_is_released_by_the_clean_up(
    docker_site: Site,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    site = make_site(tmp_path / "site", docker_site.client)
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    view = view_path(site.config, "alice", session.key)
    assert os.path.ismount(view)
    # the daemon died, and the containers went without it
    label = f"gpuresa.reservation={session.key}"
    containers = site.client.containers.list(all=True, filters={"label": label})
    assert len(containers) == 2
    for container in containers:
        container.remove(force=True)
    removed = runtime.collect_garbage(set(), network_min_age=timedelta(0))
    assert f"home view alice/{view.name}" in removed
    assert not os.path.ismount(view) and not os.path.ismount(mounted_path(site.config, "alice"))


def test_a_home_mounted_elsewhere_is_not_mounted_twice(tmp_path: Path) -> None:
    """Two loop devices on one image would damage it: another installation's mount refuses."""
    config = config_at(tmp_path)
    maps = home_maps(DOCKER_RANGE)
    view = reserve_view(config, "alice", "k1")
    assert view is not None
    attach(config, "alice", "k1", 1000, maps, view)
    assert image_path(config, "alice").parent.parent == home_root(config) == tmp_path / "homes"
    subprocess.run(["umount", str(view_path(config, "alice", "k1"))], check=True)
    subprocess.run(["umount", str(mounted_path(config, "alice"))], check=True)
    held = subprocess.run(
        ["losetup", "--find", "--show", str(image_path(config, "alice"))],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        with pytest.raises(SessionError, match="in use elsewhere"):
            attach(config, "alice", "k1", 1000, maps, view)
    finally:
        subprocess.run(["losetup", "-d", held], check=True)
    # free again: it mounts, with what was written before
    attach(config, "alice", "k1", 1000, maps, view)
    assert (view_path(config, "alice", "k1") / ".bashrc").exists()
    subprocess.run(["umount", str(view_path(config, "alice", "k1"))], check=True)
    subprocess.run(["umount", str(mounted_path(config, "alice"))], check=True)


def test_host_release_lets_go_of_homes_and_views_no_session_needs(tmp_path: Path) -> None:
    from gpuresa.backends.engines.host_holds import holdings, release

    config = config_at(tmp_path)
    maps = home_maps(DOCKER_RANGE)
    for key in ("k1", "k2"):
        view = reserve_view(config, "alice", key)
        assert view is not None
        attach(config, "alice", key, 1000, maps, view)
    held = {str(holding): holding.key for holding in holdings(config)}
    home = f"mount {mounted_path(config, 'alice')}"
    assert held[home] is None
    assert held[f"mount {view_path(config, 'alice', 'k1')}"] == safe_key("k1")
    # k2 still runs: its view and the home stay, k1's goes
    kept, released = release(config, ["k2"])
    assert {str(holding) for holding in released} == {f"mount {view_path(config, 'alice', 'k1')}"}
    assert home in {str(holding) for holding in kept}
    release(config, [], everything=True)
    assert not os.path.ismount(mounted_path(config, "alice"))
    assert not os.path.ismount(view_path(config, "alice", "k2"))
