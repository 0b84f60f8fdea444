"""A capped output leaves the disk at the end of its retention, whatever its user made of it.

A session's user shapes its output tree: a folder chain deeper than PATH_MAX,
names at NAME_MAX, hard links, holes. The copy out of its image keeps it
whole; an output that still cannot be copied out (its image damaged, the
target disk full) is listed, its user and the admin told, and removed with its
image at the end of its retention, never left on the disk for ever.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_for
from test_output_cap import capped, plain_site  # noqa: F401  (the fixture `plain_site`)
from test_runtime import (  # noqa: F401  (the fixtures `images`, `docker_site`, `site`)
    Site,
    built_fixture,
    docker_site,
    images,
    run,
    running_output,
    site_fixture,
    ssh_login,
)

from gpuresa.backends.engines.output_service import OutputService
from gpuresa.commands.output_commands import _row as row_of
from gpuresa.config.schema import Share
from gpuresa.daemon.output_duties import OutputDuties
from gpuresa.outputs.capped import image_path
from gpuresa.outputs.copying import copy_tree
from gpuresa.outputs.handover import retry_pending
from gpuresa.outputs.owners import output_owner
from gpuresa.outputs.records import image_relative
from gpuresa.outputs.running_area import pending, stored_path

DEPTH = 600
LINK = "d" * 8
LONG_NAME = "n" * 255

# (relative names, kind, size, content digest or link target, mtime): what a copy must keep
Snapshot = dict[tuple[str, ...], tuple[str, int, str, int]]


def snapshot(top: Path) -> Snapshot:
    """Every entry below `top` by its names from `top`, at any depth, links never followed."""
    found: Snapshot = {}
    for folder, folders, files, descriptor in os.fwalk(top, follow_symlinks=False):
        prefix = tuple(Path(os.path.relpath(folder, top)).parts) if folder != str(top) else ()
        for name in folders + files:
            details = os.stat(name, dir_fd=descriptor, follow_symlinks=False)
            mode, content = details.st_mode, ""
            if stat.S_ISLNK(mode):
                content = os.readlink(name, dir_fd=descriptor)
            elif stat.S_ISREG(mode):
                reading = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=descriptor)
                with os.fdopen(reading, "rb") as stream:
                    content = hashlib.sha256(stream.read()).hexdigest()
            kind = stat.filemode(mode)[0]
            found[(*prefix, name)] = (kind, details.st_size if kind == "-" else 0, content,
                                      details.st_mtime_ns)  # fmt: skip
    return found


def deep_chain(top: Path, depth: int, bottom: bytes) -> None:
    """`depth` nested folders `LINK` below `top`, a file `bottom` at the end (by descriptors)."""
    current = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(LINK, dir_fd=current)
            child = os.open(LINK, os.O_RDONLY | os.O_DIRECTORY, dir_fd=current)
            os.close(current)
            current = child
        descriptor = os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=current)
        os.write(descriptor, bottom)
        os.close(descriptor)
    finally:
        os.close(current)


def test_a_tree_beyond_path_max_is_copied_whole_and_as_it_was(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    deep_chain(source, DEPTH, b"at the bottom\n")
    (source / LONG_NAME).write_bytes(b"a name at NAME_MAX")
    (source / "sub").mkdir(mode=0o711)
    (source / "sub" / LONG_NAME).mkdir()
    os.symlink("/etc/passwd", source / "link-to-passwd")
    os.symlink("missing", source / "dangling")
    big = source / "big"
    big.write_bytes(b"x" * 1000)
    os.link(big, source / "big-again")
    sparse = source / "sparse"
    with sparse.open("wb") as stream:
        stream.seek(64 << 20)
        stream.write(b"end")
    privileged = source / "privileged"
    privileged.write_bytes(b"#!/bin/sh\n")
    os.chmod(privileged, 0o6755)
    os.mkfifo(source / "pipe")
    os.utime(source / LONG_NAME, ns=(1_000_000_000, 2_000_000_000))
    before = snapshot(source)

    target = tmp_path / "target"
    copy_tree(source, target)

    assert snapshot(target) == before
    assert len(max(before, key=len)) == DEPTH + 1
    # what cp -a kept, less the privilege bits the hand-over clears anyway
    assert stat.S_IMODE((target / "sub").stat().st_mode) == 0o711
    assert stat.S_IMODE(os.lstat(target / "privileged").st_mode) == 0o755
    assert (target / "big").stat().st_ino == (target / "big-again").stat().st_ino
    assert (target / "sparse").stat().st_blocks * 512 < 1 << 20
    assert os.readlink(target / "link-to-passwd") == "/etc/passwd"
    assert not (tmp_path / ".target.links").exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem of its own (tmpfs), unmounted at the end."""
    point = tmp_path / "small"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_a_copy_that_fills_its_disk_leaves_nothing_half_copied(
    tmp_path: Path, small_disk: Path
) -> None:
    source = tmp_path / "source"
    (source / "first").mkdir(parents=True)
    (source / "first" / "small").write_bytes(b"s" * 1000)
    (source / "second").write_bytes(os.urandom(4 << 20))
    with pytest.raises(OSError, match="No space left"):
        copy_tree(source, small_disk / "target")
    assert os.listdir(small_disk) == []


def with_retention(site: Site) -> Site:
    storage = dataclasses.replace(
        site.config.storage,
        output_retention=timedelta(days=7),
        output_removal_notice=timedelta(days=1),
    )
    return dataclasses.replace(site, config=dataclasses.replace(site.config, storage=storage))


def prune_after_retention(service: OutputService, ended: datetime) -> list[Path]:
    """Send the removal notices when due, then prune once retention is over; what went."""
    told = ended + timedelta(days=6, hours=1)
    for folder in service.due_removal_notices(told):
        service.notice_sent(folder, told)
    assert service.prune(told) == []
    return [folder.path for folder in service.prune(ended + timedelta(days=8))]


def listing(service: OutputService) -> list[dict[str, Any]]:
    """The rows `gpuresa outputs list --json` prints."""
    return [row_of(folder, service) for folder in service.folders()]


def test_a_session_deeper_than_path_max_is_handed_over_whole_then_pruned(
    site: Site,  # Docker and Podman
) -> None:
    site = with_retention(capped(site))
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    image = image_path(site.config, session.key)
    try:
        with ssh_login(session, "alice", site.key("alice")) as client:
            code, output = run(
                client,
                f"cd -P /output && n=$(printf 'n%.0s' $(seq 255)) && echo long > $n && "
                f"for i in $(seq {DEPTH}); do mkdir {LINK} && cd -P {LINK} || exit 1; done && "
                "echo deep > bottom && ln -s /etc/shadow shadow && ln bottom bottom-again 2>&1",
            )
            assert code == 0, output
        before = snapshot(running_output(site, session))
    finally:
        runtime.stop(session.key, timedelta(seconds=1))
    ended = datetime.now(UTC)
    assert not image.exists()
    assert snapshot(session.output_dir) == before
    bottom = session.output_dir.joinpath(*[LINK] * DEPTH)
    assert len(str(bottom)) > os.pathconf("/", "PC_PATH_MAX")
    # handed over: root's, the group of its login, read-only (checked through a descriptor)
    reading = os.open(session.output_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(DEPTH):
            child = os.open(LINK, os.O_RDONLY | os.O_DIRECTORY, dir_fd=reading)
            os.close(reading)
            reading = child
        details = os.stat("bottom", dir_fd=reading)
    finally:
        os.close(reading)
    assert (details.st_uid, details.st_gid) == (0, output_owner("alice", site.config).gid)
    assert stat.S_IMODE(details.st_mode) == 0o640

    service = OutputService(site.config, runtime)
    [row] = [row for row in listing(service) if row["key"] == session.key]
    assert row["path"] == str(session.output_dir) and not row["in_image"]
    assert prune_after_retention(service, ended) == [session.output_dir]
    assert not session.output_dir.exists() and not image.exists()
    assert pending(site.config) == []


def loop_free(image: Path) -> bool:
    """Whether no loop device holds `image` any more (its last mount is gone everywhere)."""
    found = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True)
    return found.returncode == 0 and found.stdout.strip() == ""


def damage(image: Path) -> None:
    """Zero the image's first blocks (its superblock): a disk error, as far as mount can tell.

    Done once its filesystem is unmounted in every namespace (a container's going
    away is not instant): the last unmount writes the superblock back.
    """
    wait_for(lambda: loop_free(image), 30, "the image's last mount to go")
    with image.open("r+b") as stream:
        stream.write(bytes(1 << 16))
        os.fsync(stream.fileno())


@pytest.mark.parametrize("failure", ["damaged image", "no room on the disk"])
def test_an_output_that_cannot_be_copied_out_is_listed_told_and_pruned(
    plain_site: Site,  # noqa: F811  (the fixture imported above)
    failure: str,
) -> None:
    site = with_retention(capped(plain_site))
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    with ssh_login(session, "alice", site.key("alice")) as client:
        assert run(client, "dd if=/dev/urandom of=/output/result bs=1M count=4 2>&1")[0] == 0
    # the host goes down mid-session: no stop, no hand-over
    for name in session.containers:
        site.client.api.remove_container(name, force=True)
    image = image_path(site.config, session.key)
    if failure == "damaged image":
        for point in (running_output(site, session), stored_path(site.config, session.key)):
            while os.path.ismount(point):
                subprocess.run(["umount", str(point)], check=True)
        damage(image)
        expected = "cannot be copied out of its image"
    else:
        # the disk filled meanwhile: all but a sliver of it must stay free
        storage = dataclasses.replace(site.config.storage, free_refuse=Share(0.9999))
        site = dataclasses.replace(site, config=dataclasses.replace(site.config, storage=storage))
        expected = "the output disk has no room to copy"
    # the daemon comes back an hour later: the output is a leftover, no session being made
    an_hour_ago = time.time() - 3600
    stored = stored_path(site.config, session.key)
    os.utime(stored.with_name(f"{stored.name}.json"), (an_hour_ago,) * 2)

    ended = datetime.now(UTC)
    service = OutputService(site.config, runtime)
    duties = OutputDuties(service)
    to_user: list[tuple[str, str, str, str]] = []
    to_admin: list[tuple[str, str]] = []

    def tell_user(key: str, kind: str, login: str, _email: str | None, message: Any) -> bool:
        to_user.append((key, kind, login, message[1]))
        return True

    def tell_admin(key: str, _kind: str, _subject: str, body: str) -> bool:
        to_admin.append((key, body))
        return True

    line = duties._hand_overs(ended, [], tell_user, tell_admin)
    assert f"1 hand-over(s) failing ({session.key})" in line
    assert [key for key, _body in to_admin] == [session.key]
    assert expected in to_admin[0][1], to_admin
    [(key, kind, login, body)] = to_user
    assert (key, kind, login) == (session.key, "output-in-image", "alice")
    assert "kept 7 days after the end of your session" in body, body
    # the output whole in its image, nothing half-copied beside it
    assert image.is_file() and (not stored.exists() or os.listdir(stored) == [])
    # listed, with its size, as an output kept in its image
    [row] = [row for row in listing(service) if row["key"] == session.key]
    assert row["in_image"] and row["path"] == str(image) and row["removal"] is not None
    assert row["bytes"] == image.stat().st_size
    # a later try fails again: its retention does not start afresh
    assert retry_pending(site.config, set(), lambda key, why: None, ended + timedelta(days=2)) == 0
    record = service.records.read(image_relative(session.key))
    assert record is not None and record["ended"] == ended.isoformat()

    assert prune_after_retention(service, ended) == [image]
    assert not image.exists() and pending(site.config) == []
    assert not stored_path(site.config, session.key).exists()
    assert [row for row in listing(service) if row["key"] == session.key] == []
