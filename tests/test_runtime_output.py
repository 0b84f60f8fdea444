"""Output folders on the host: their path, their owner, and the hand-over after a session."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpuresa.config.reading import parse_config
from gpuresa.model import SessionSpec
from gpuresa.outputs import tree
from gpuresa.outputs.folder import hand_over, output_path, prepare_output, remap_base
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key

REMAPPED = 100000


def spec(key: str = "evt-1@example.org") -> SessionSpec:
    return SessionSpec(
        key=key,
        user="alice",
        host="gpu1",
        template="pytorch",
        cuda="12.4",
        gpu_count=0,
        gpu_indices=(),
        start=datetime(2026, 3, 2, 8, 0, tzinfo=UTC),
        end=datetime(2026, 3, 2, 17, 0, tzinfo=UTC),
        ssh_port=20000,
        ftp_port=21000,
        ftp_passive_first=30000,
        ftp_passive_last=30009,
    )


def test_the_default_pattern_uses_the_site_time_and_a_safe_key(tmp_path: Path) -> None:
    config = parse_config(
        {
            "reservations": {"timezone": "Europe/Paris"},
            "storage": {"output_root": str(tmp_path)},
        },
        "test.toml",
    )
    key = "a/../b@c"
    assert output_path(config, spec(key)) == tmp_path / "alice" / f"20260302-0900-{safe_key(key)}"


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("{user}/{nope}", "cannot be filled in"),
        ("{user}/../../etc", "not a relative path"),
        ("{user}/{key}/..", "not a relative path"),
    ],
)
def test_a_pattern_that_leaves_the_output_root_is_refused(
    tmp_path: Path, pattern: str, reason: str
) -> None:
    config = parse_config(
        {"storage": {"output_root": str(tmp_path), "output_pattern": pattern}}, "test.toml"
    )
    with pytest.raises(SessionError, match=reason):
        output_path(config, spec())


def test_the_folder_is_given_to_the_remapped_uid(tmp_path: Path) -> None:
    folder = tmp_path / "alice" / "session"
    prepare_output(folder, REMAPPED + 20123, REMAPPED + 20123, "key")
    details = folder.stat()
    assert (details.st_uid, details.st_gid) == (REMAPPED + 20123, REMAPPED + 20123)
    assert details.st_mode & 0o777 == 0o750
    # its parents stay root's
    assert (tmp_path / "alice").stat().st_uid == os.getuid()


def test_an_earlier_hand_over_is_undone_for_a_new_session(tmp_path: Path) -> None:
    folder = tmp_path / "session"
    folder.mkdir()
    (folder / "result.txt").write_text("kept")
    os.chown(folder / "result.txt", 1001, 1001)
    prepare_output(folder, REMAPPED + 20123, REMAPPED + 20123, "key")
    assert (folder / "result.txt").stat().st_uid == REMAPPED + 20123
    assert (folder / "result.txt").read_text() == "kept"


def test_a_linked_output_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "session").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SessionError, match="symbolic link"):
        prepare_output(tmp_path / "session", REMAPPED + 1, REMAPPED + 1, "key")


def test_hand_over_never_follows_a_link_the_user_left(tmp_path: Path) -> None:
    folder = tmp_path / "session"
    folder.mkdir()
    (folder / "sub").mkdir()
    (folder / "sub" / "model.pt").write_text("weights")
    secret = tmp_path / "secret"
    secret.write_text("root's")
    (folder / "link").symlink_to(secret)
    for path in (folder, folder / "sub", folder / "sub" / "model.pt"):
        os.chown(path, REMAPPED + 5, REMAPPED + 5)
    hand_over(folder, 1001, 1002, "key")
    for path in (folder, folder / "sub", folder / "sub" / "model.pt"):
        assert (path.stat().st_uid, path.stat().st_gid) == (1001, 1002)
    assert os.lstat(folder / "link").st_uid == 1001
    assert secret.stat().st_uid == os.getuid()


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (
            {
                "SecurityOptions": ["name=seccomp,profile=default", "name=userns"],
                "DockerRootDir": "/var/lib/docker/100000.100000",
            },
            (100000, 100000),
        ),
        (
            {
                "SecurityOptions": ["name=seccomp,profile=default"],
                "DockerRootDir": "/var/lib/docker",
            },
            (0, 0),
        ),
    ],
)
def test_the_remapped_ids_come_from_the_engine(
    info: dict[str, object], expected: tuple[int, int]
) -> None:
    assert remap_base(info) == expected


def test_hand_over_is_safe_against_a_folder_swapped_for_a_link_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the user owns the folders, so while they are walked it can move a
    # subfolder away and leave a link to a root-owned folder in its place
    folder = tmp_path / "session"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "model.pt").write_text("weights")
    for path in (folder, folder / "sub", folder / "sub" / "model.pt"):
        os.chown(path, REMAPPED + 5, REMAPPED + 5)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "model.pt").write_text("root's")
    real_chown = tree._chown_descriptor
    swapped: list[Any] = []

    def chown(descriptor: int, *args: Any) -> None:
        # just before the file in the subfolder is given: the swap
        if not swapped and os.readlink(f"/proc/self/fd/{descriptor}").endswith("model.pt"):
            (folder / "sub").rename(folder / "moved")
            (folder / "sub").symlink_to(etc)
            swapped.append(descriptor)
        real_chown(descriptor, *args)

    monkeypatch.setattr(tree, "_chown_descriptor", chown)
    hand_over(folder, 1001, 1002, "key")
    monkeypatch.undo()
    assert swapped
    assert (etc / "model.pt").stat().st_uid == os.getuid()
    assert etc.stat().st_uid == os.getuid()
    # what the user had is still handed over, the top folder included
    assert (folder / "moved" / "model.pt").stat().st_uid == 1001
    assert (folder.stat().st_uid, folder.stat().st_gid) == (1001, 1002)


def test_hand_over_gives_nested_folders_and_a_link_to_a_folder_itself(tmp_path: Path) -> None:
    folder = tmp_path / "session"
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "c.txt").write_text("deep")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "inside.txt").write_text("root's")
    (folder / "a" / "to-outside").symlink_to(outside)
    hand_over(folder, 1001, 1002, "key")
    for path in (folder, folder / "a", folder / "a" / "b", folder / "a" / "b" / "c.txt"):
        assert (path.stat().st_uid, path.stat().st_gid) == (1001, 1002)
    assert os.lstat(folder / "a" / "to-outside").st_uid == 1001
    assert outside.stat().st_uid == os.getuid()
    assert (outside / "inside.txt").stat().st_uid == os.getuid()
