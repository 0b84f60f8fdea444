"""What a home's folders, images and disk must be before gpuresa mounts one, and what a
half-done step leaves: real images, loop mounts and idmapped views, no engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.accounts import throwaway_account

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.homes.folders import folder_home
from gpuresa.homes.paths import DISK_ID_BASE, image_path, images_folder, mounted_path
from gpuresa.homes.retention import review
from gpuresa.homes.store import attach, detach, home_maps, reserve_view
from gpuresa.model import IdRange
from gpuresa.sessions.errors import SessionError

DOCKER_RANGE = IdRange(100000, 100000, 65536)


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A folder of root's that every account may traverse, outside pytest's root-only ones."""
    root = Path(tempfile.mkdtemp(prefix="gpuresa-homes-", dir="/var/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            point = line.split()[4]
            if point.startswith(str(root)):
                subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(root, ignore_errors=True)


def config_at(root: Path, **storage: str) -> Config:
    return parse_config(
        {
            "daemon": {"state_dir": str(root / "state")},
            "storage": {"output_root": str(root / "output"), **storage},
        },
        "test.toml",
    )


def show(config: Config, login: str, key: str) -> Path:
    view = reserve_view(config, login, key)
    assert view is not None
    attach(config, login, key, 1000, home_maps(DOCKER_RANGE), view)
    return view


def test_a_homes_files_are_nobodys_on_disk_and_the_sessions_own_in_its_view(
    tmp_path: Path,
) -> None:
    config = config_at(tmp_path)
    view = show(config, "alice", "k1")
    try:
        # on disk the login's uid 1000 is DISK_ID_BASE + 1000, no host account's
        assert mounted_path(config, "alice").stat().st_uid == DISK_ID_BASE + 1000
        assert view.stat().st_uid == DOCKER_RANGE.uid + 1000
        assert view.stat().st_mode & 0o777 == 0o700
        assert image_path(config, "alice").stat().st_mode & 0o777 == 0o600
    finally:
        detach(config, "k1")


@pytest.mark.parametrize("flaw", ["world-writable", "a-users"])
def test_a_home_root_someone_else_could_make_or_replace_is_refused(
    open_root: Path, flaw: str
) -> None:
    parent = open_root / "scratch"
    parent.mkdir()
    with throwaway_account("ghr") as uid:
        if flaw == "world-writable":
            parent.chmod(0o777)  # no sticky bit: anyone may replace what is in it
        else:
            parent.chmod(0o755)
            (parent / "homes").mkdir()
            os.chown(parent / "homes", uid, uid)  # made first by a host user
        config = config_at(open_root, home_root=str(parent / "homes"))
        with pytest.raises(SessionError, match="refusing to keep homes there"):
            show(config, "alice", "k1")
    assert not image_path(config, "alice").exists()


def test_an_image_planted_or_linked_is_not_mounted(tmp_path: Path) -> None:
    config = config_at(tmp_path)
    show(config, "alice", "k1")
    detach(config, "k1")
    image = image_path(config, "alice")
    # another name for it (a hard link someone could keep), then a mode opened to others
    os.link(image, images_folder(config) / "spare")
    with pytest.raises(SessionError, match="other names"):
        show(config, "alice", "k2")
    (images_folder(config) / "spare").unlink()
    image.chmod(0o644)
    with pytest.raises(SessionError, match="open to others"):
        show(config, "alice", "k3")
    image.chmod(0o600)
    os.chown(image, 1000, 1000)
    with pytest.raises(SessionError, match="not a file of root's"):
        show(config, "alice", "k4")
    for key in ("k2", "k3", "k4"):
        detach(config, key)


def test_a_half_made_image_of_a_killed_daemon_does_not_refuse_its_user(tmp_path: Path) -> None:
    config = config_at(tmp_path)
    show(config, "bob", "k0")  # the folders exist
    detach(config, "k0")
    # a daemon killed between the image's file and its mkfs
    (images_folder(config) / "alice.img.new").write_bytes(b"\0" * 4096)
    view = show(config, "alice", "k1")
    try:
        assert (view / ".bashrc").exists()
        assert not (images_folder(config) / "alice.img.new").exists()
    finally:
        detach(config, "k1")


def test_homes_are_not_promised_more_than_their_disk_has(open_root: Path) -> None:
    disk = open_root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "none", str(disk)], check=True)
    config = config_at(open_root, home_root=str(disk / "homes"), home_quota="64M")
    show(config, "alice", "k1")
    try:
        # a second 64 MB home could grow into the room the first still may take
        with pytest.raises(SessionError, match="no room for this home to grow"):
            show(config, "bob", "k2")
        detach(config, "k2")
        # alone on the disk it mounts
        detach(config, "k1")
        show(config, "bob", "k3")
        detach(config, "k3")
    finally:
        detach(config, "k1")


def test_a_home_left_at_a_time_with_nanoseconds_is_still_removed(tmp_path: Path) -> None:
    """The time set by a session's end (`os.utime()`: now, to the nanosecond)."""
    config = config_at(tmp_path, home_retention="1d", home_removal_notice="1h")
    show(config, "alice", "k1")
    detach(config, "k1")
    image = image_path(config, "alice")
    assert image.stat().st_mtime_ns % 1000 != 0 or image.stat().st_mtime_ns % 10**9 != 0
    sent: list[str] = []

    def to_user(key: str, kind: str, login: str, email: str | None, message: object) -> bool:
        sent.append(kind)
        return True

    now = datetime.now(UTC)
    review(config, now + timedelta(hours=23, minutes=30), to_user)
    assert len(sent) == 1 and image.exists()
    review(config, now + timedelta(days=2), to_user)
    assert not image.exists()


def test_a_folder_home_is_made_aside_and_never_through_a_link(open_root: Path) -> None:
    config = config_at(open_root)
    shared = open_root / "shared"
    with throwaway_account("gfh") as uid:
        home = folder_home(config, shared, "alice", (uid, uid))
        assert home is not None
        details = home.lstat()
        assert (details.st_uid, details.st_mode & 0o777) == (uid, 0o700)
        assert (home / ".bashrc").lstat().st_uid == uid
        assert not (shared / "homes" / ".alice.new").exists()
        # the folder of homes is root's: a login cannot put a link where a home goes
        assert (shared / "homes").stat().st_uid == 0
        (shared / "homes" / "mallory").symlink_to("/etc")
        with pytest.raises(SessionError, match="not a folder"):
            folder_home(config, shared, "mallory", (uid, uid))
        assert Path("/etc").stat().st_uid == 0
