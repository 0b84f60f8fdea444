"""Root's folders and files for keys and certificates: owners, modes, and links refused.

Every test runs as root on real files; the hostile ones plant the links a
user who owns (or can write) the folder would plant.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from gpuresa.safe_files import create_once, private_folder, replace_file

# ids of nobody in particular: root may give files to any id
OWNER = 64_123
OTHER = 64_124


def ownership(path: Path) -> tuple[int, int, int]:
    details = path.lstat()
    return details.st_uid, details.st_gid, stat.S_IMODE(details.st_mode)


def leftovers(folder: Path) -> list[str]:
    return [path.name for path in folder.iterdir() if path.name.startswith(".new-")]


def test_a_private_folder_is_made_with_its_parents_for_its_owner_alone(tmp_path: Path) -> None:
    folder = private_folder(tmp_path / "state" / "keys", OWNER, OWNER)
    assert folder == tmp_path / "state" / "keys"
    assert ownership(folder) == (OWNER, OWNER, 0o700)


def test_an_existing_folder_is_closed_and_given_to_its_owner(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    private_folder(folder, OWNER, OWNER)
    assert ownership(folder) == (OWNER, OWNER, 0o700)
    private_folder(folder)  # and back to root's: every call sets both
    assert ownership(folder) == (0, 0, 0o700)


def test_a_link_in_place_of_the_folder_is_refused_and_its_target_left_alone(
    tmp_path: Path,
) -> None:
    # a user who could write the parent points the name at a folder of another's
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chown(victim, OTHER, OTHER)
    os.chmod(victim, 0o755)
    (tmp_path / "keys").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        private_folder(tmp_path / "keys", OWNER, OWNER)
    assert ownership(victim) == (OTHER, OTHER, 0o755)
    # a link to a file, or to nothing, is refused as well
    (tmp_path / "to-file").symlink_to("/etc/passwd")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = ownership(Path("/etc/passwd"))
    for name in ("to-file", "dangling"):
        with pytest.raises(OSError):
            private_folder(tmp_path / name, OWNER, OWNER)
    assert ownership(Path("/etc/passwd")) == before
    assert not (tmp_path / "nowhere").exists()


def test_a_file_in_place_of_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("not a folder")
    with pytest.raises(OSError):
        private_folder(tmp_path / "keys")
    assert (tmp_path / "keys").read_text() == "not a folder"


def test_a_replaced_file_has_its_owner_and_mode_and_nothing_is_left_beside_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "host_key"
    replace_file(path, b"private\n", 0o600, OWNER, OWNER)
    assert path.read_bytes() == b"private\n" and ownership(path) == (OWNER, OWNER, 0o600)
    replace_file(path, b"public\n", 0o644)
    assert path.read_bytes() == b"public\n" and ownership(path) == (0, 0, 0o644)
    assert leftovers(tmp_path) == []


def test_a_link_at_a_replaced_name_is_replaced_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's\n")
    os.chown(victim, OTHER, OTHER)
    path = tmp_path / "host_key"
    path.symlink_to(victim)
    replace_file(path, b"key\n", 0o600, OWNER, OWNER)
    assert not path.is_symlink() and path.read_bytes() == b"key\n"
    assert victim.read_bytes() == b"the victim's\n" and ownership(victim)[:2] == (OTHER, OTHER)


def test_a_failed_replacement_leaves_no_file_behind(tmp_path: Path) -> None:
    # the name is a folder: the rename fails, the fresh file goes
    (tmp_path / "host_key").mkdir()
    with pytest.raises(OSError):
        replace_file(tmp_path / "host_key", b"key\n")
    assert leftovers(tmp_path) == []


def test_a_file_made_once_keeps_the_first_makers_content(tmp_path: Path) -> None:
    path = tmp_path / "ca_key"
    create_once(path, b"first\n")
    create_once(path, b"second\n")
    assert path.read_bytes() == b"first\n" and ownership(path) == (0, 0, 0o600)
    assert leftovers(tmp_path) == []


def test_makers_at_once_agree_on_one_file(tmp_path: Path) -> None:
    path = tmp_path / "ca_key"
    start = threading.Barrier(8)

    def make(index: int) -> None:
        start.wait()
        create_once(path, f"maker {index}\n".encode())

    threads = [threading.Thread(target=make, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_text() in {f"maker {index}\n" for index in range(8)}
    assert leftovers(tmp_path) == []
