"""Logins, SSH keys, container uids and FTP credentials (gpuresa.access)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuresa.access import (
    HIGHEST_CONTAINER_UID,
    MAX_KEY_FILE_SIZE,
    STABLE_UID_SPAN,
    AccessError,
    Account,
    authorized_keys,
    check_login,
    container_uid,
    ftp_credentials,
    key_sources,
)
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import UsersConfig

ED25519 = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG9rZXlrZXlrZXlrZXlrZXlrZXlrZXlrZXlrZXlrZXk alice@laptop"
)
RSA = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 alice@desktop"


def users(tmp_path: Path, **settings: Any) -> UsersConfig:
    config = parse_config({"users": {"keys_dir": str(tmp_path / "keys"), **settings}}, "test.toml")
    (tmp_path / "keys").mkdir(exist_ok=True)
    return config.users


def nobody_on_host(login: str) -> Account | None:
    return None


def test_keys_come_from_the_login_pub_file(tmp_path: Path) -> None:
    config = users(tmp_path)
    (tmp_path / "keys" / "alice.pub").write_text(f"# alice's laptop\n\n{ED25519}\n{RSA}\n")
    assert authorized_keys("alice", config, nobody_on_host) == f"{ED25519}\n{RSA}\n"


def test_keys_come_from_the_login_folder_when_there_is_no_pub_file(tmp_path: Path) -> None:
    config = users(tmp_path)
    (tmp_path / "keys" / "alice").mkdir()
    (tmp_path / "keys" / "alice" / "authorized_keys").write_text(f'from="10.0.0.0/8" {ED25519}\n')
    assert authorized_keys("alice", config, nobody_on_host) == f'from="10.0.0.0/8" {ED25519}\n'


def test_keys_fall_back_to_the_host_account(tmp_path: Path) -> None:
    config = users(tmp_path)
    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text(RSA + "\n")

    def account_of(login: str) -> Account | None:
        return Account(login, 1001, 1001, home) if login == "alice" else None

    assert authorized_keys("alice", config, account_of) == RSA + "\n"
    # unless the site turned the fallback off
    strict = users(tmp_path, host_authorized_keys=False)
    with pytest.raises(AccessError):
        authorized_keys("alice", strict, account_of)
    assert home / ".ssh" / "authorized_keys" not in key_sources("alice", strict, account_of)


def test_a_login_without_a_key_is_refused_with_where_to_put_one(tmp_path: Path) -> None:
    config = users(tmp_path)
    # a file with no key in it does not count either
    (tmp_path / "keys" / "bob.pub").write_text("# key to come\nnot a key\n")
    with pytest.raises(AccessError) as caught:
        authorized_keys("bob", config, nobody_on_host)
    message = str(caught.value)
    assert "no SSH public key for login 'bob'" in message
    assert str(tmp_path / "keys" / "bob.pub") in message


@pytest.mark.parametrize(
    "login",
    [
        "",
        "Alice",
        "a/b",
        "../etc",
        "alice bob",
        "1alice",
        "-alice",
        "a" * 33,
        "alice\n",
        "root",
        "sshd",
    ],
)
def test_bad_or_reserved_logins_are_refused(login: str) -> None:
    with pytest.raises(AccessError):
        check_login(login)


def test_key_lookup_refuses_a_login_that_would_escape_the_keys_folder(tmp_path: Path) -> None:
    config = users(tmp_path)
    (tmp_path / "x.pub").write_text(ED25519)
    with pytest.raises(AccessError, match="not a valid login"):
        authorized_keys("../x", config, nobody_on_host)


@pytest.mark.parametrize("login", ["alice", "_svc", "bob-2", "a" * 32])
def test_good_logins_pass(login: str) -> None:
    assert check_login(login) == login


def test_configured_uid_wins_then_host_uid_then_a_stable_number(tmp_path: Path) -> None:
    config = users(tmp_path, uids={"alice": 4242}, uid_base=30000)
    home = tmp_path

    def account_of(login: str) -> Account | None:
        known = {"alice": 1001, "carol": 1500, "daemonish": 2}
        return Account(login, known[login], known[login], home) if login in known else None

    assert container_uid("alice", config, account_of) == 4242
    assert container_uid("carol", config, account_of) == 1500
    # a system uid on the host is not taken over
    stable = container_uid("daemonish", config, account_of)
    assert 30000 <= stable < 30000 + STABLE_UID_SPAN
    first = container_uid("dave", config, account_of)
    assert first == container_uid("dave", config, account_of)
    assert 30000 <= first < 30000 + STABLE_UID_SPAN


def test_a_uid_outside_the_remapped_range_is_refused(tmp_path: Path) -> None:
    config = users(tmp_path, uid_base=HIGHEST_CONTAINER_UID)
    with pytest.raises(AccessError, match="outside"):
        # most logins hash above the last mapped uid from there
        for login in ("alice", "bob", "carol", "dave"):
            container_uid(login, config, nobody_on_host)


def test_ftp_credentials_are_fresh_for_every_session() -> None:
    first, second = ftp_credentials("alice"), ftp_credentials("alice")
    assert first.user == second.user == "alice"
    assert first.password != second.password
    assert len(first.password) >= 24
    assert all(character.isalnum() or character in "-_" for character in first.password)
    assert first.password not in repr(first)


def account_at(home: Path) -> Callable[[str], Account | None]:
    def account_of(login: str) -> Account | None:
        return Account(login, 1001, 1001, home) if login == "alice" else None

    return account_of


def keys_within(seconds: float, config: UsersConfig, home: Path) -> str | AccessError:
    """What `authorized_keys` gives for alice (or raises), failing the test if it hangs."""
    outcome: list[str | AccessError] = []

    def ask() -> None:
        try:
            outcome.append(authorized_keys("alice", config, account_at(home)))
        except AccessError as error:
            outcome.append(error)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(seconds)
    if asking.is_alive():
        # let the stuck reader go before failing
        for fifo in home.rglob("*"):
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"authorized_keys still waiting after {seconds} s")
    return outcome[0]


def test_a_fifo_for_authorized_keys_is_refused_without_waiting(tmp_path: Path) -> None:
    config = users(tmp_path)
    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    os.mkfifo(home / ".ssh" / "authorized_keys")
    os.mkfifo(tmp_path / "keys" / "alice.pub")
    result = keys_within(5, config, home)
    assert isinstance(result, AccessError)
    assert "authorized_keys is not a regular file" in str(result)
    assert "alice.pub is not a regular file" in str(result)


@pytest.mark.parametrize("target", ["secret", "/dev/zero"])
def test_a_linked_authorized_keys_in_a_home_is_refused(tmp_path: Path, target: str) -> None:
    config = users(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(RSA + "\n")  # root's, readable by root only
    secret.chmod(0o600)
    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").symlink_to(secret if target == "secret" else target)
    result = keys_within(5, config, home)
    assert isinstance(result, AccessError)
    assert "symbolic link" in str(result)
    assert RSA not in str(result)


def test_a_linked_ssh_folder_in_a_home_is_refused(tmp_path: Path) -> None:
    config = users(tmp_path)
    roots = tmp_path / "root" / ".ssh"
    roots.mkdir(parents=True)
    (roots / "authorized_keys").write_text(RSA + "\n")
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    (home / ".ssh").symlink_to(roots)
    result = keys_within(5, config, home)
    assert isinstance(result, AccessError)
    assert "symbolic link" in str(result)


def test_an_authorized_keys_of_another_user_is_refused(tmp_path: Path) -> None:
    config = users(tmp_path)
    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text(RSA + "\n")
    os.chown(home / ".ssh" / "authorized_keys", 1002, 1002)
    result = keys_within(5, config, home)
    assert isinstance(result, AccessError)
    assert "belongs to uid 1002" in str(result)
    # the user's own file is read
    os.chown(home / ".ssh" / "authorized_keys", 1001, 1001)
    assert keys_within(5, config, home) == RSA + "\n"


def test_key_files_past_the_size_cap_are_refused(tmp_path: Path) -> None:
    config = users(tmp_path)
    padding = "# " + "x" * MAX_KEY_FILE_SIZE + "\n"
    (tmp_path / "keys" / "alice.pub").write_text(f"{ED25519}\n{padding}")
    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text(f"{RSA}\n{padding}")
    result = keys_within(5, config, home)
    assert isinstance(result, AccessError)
    assert f"alice.pub is larger than {MAX_KEY_FILE_SIZE} bytes" in str(result)
    assert f"authorized_keys is larger than {MAX_KEY_FILE_SIZE} bytes" in str(result)
    # a file just within the cap is read
    within = f"{ED25519}\n" + "#" * (MAX_KEY_FILE_SIZE - len(ED25519) - 2) + "\n"
    (tmp_path / "keys" / "alice.pub").write_text(within)
    assert keys_within(5, config, home) == ED25519 + "\n"
