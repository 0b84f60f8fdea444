"""Who may get into a session, and how: logins, SSH keys, uids, FTP credentials.

Pure lookups on the host's files; nothing here talks to Docker. The runtime
asks these questions before it creates anything, so a booking with a bad login
or no key is refused with a reason and leaves nothing behind.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import pwd
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuresa.config.names import LOGIN
from gpuresa.config.sections import UsersConfig
from gpuresa.errors import UserError

log = logging.getLogger(__name__)

LOGIN_PATTERN = re.compile(LOGIN)

# Accounts that images already have (Debian's and Ubuntu's base-passwd, common
# daemons): a booking may never take one over.
RESERVED_LOGINS = frozenset(
    {
        "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news",
        "uucp", "proxy", "www-data", "backup", "list", "irc", "gnats", "nobody", "_apt",
        "sshd", "ftp", "messagebus", "syslog", "systemd-network", "systemd-resolve",
        "systemd-timesync", "polkitd", "ubuntu", "admin", "operator", "adm", "sudo",
        "staff", "users", "shadow", "utmp", "tty", "disk", "video", "audio", "nogroup",
    }
)  # fmt: skip

# uids from the stable per-login mapping: uid_base up to uid_base + this - 1
STABLE_UID_SPAN = 10000
# the highest uid a container may use: a remapped range has 65536 ids, the last
# two are traditionally nobody/nogroup
HIGHEST_CONTAINER_UID = 65533
# the largest key file read (a few hundred keys); a bigger one is refused
MAX_KEY_FILE_SIZE = 256 * 1024
# the lowest host uid taken over as a container uid (lower ones are system accounts)
LOWEST_HOST_UID = 1000

_KEY_LINE = re.compile(
    r"(?:^|\s)(?:ssh-(?:rsa|ed25519|dss)|ecdsa-sha2-nistp(?:256|384|521)"
    r"|sk-(?:ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com)\s+[A-Za-z0-9+/]+=*(?:\s|$)"
)


class AccessError(UserError):
    """A login that cannot get a session: invalid, reserved, or without a key."""


@dataclass(frozen=True)
class Account:
    """A login's account on this host, as the password database has it."""

    login: str
    uid: int
    gid: int
    home: Path


@dataclass(frozen=True)
class FtpCredentials:
    """The FTP login of one session and its random password."""

    user: str
    password: str = field(repr=False)


def host_account(login: str) -> Account | None:
    """The host's account named `login`, or None when the host has none."""
    try:
        entry = pwd.getpwnam(login)
    except KeyError:
        return None
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def check_login(login: str) -> str:
    """Return `login` when it may have a session; raise `AccessError` saying why not.

    A login is lower-case letters, digits, '_' and '-' (at most 32, not starting
    with a digit or '-'), and is not one of the system accounts images carry.
    """
    if not isinstance(login, str) or not LOGIN_PATTERN.fullmatch(login):
        raise AccessError(
            f"{login!r} is not a valid login (lower-case letters, digits, '_' and '-', "
            "at most 32, starting with a letter or '_')"
        )
    if login in RESERVED_LOGINS:
        raise AccessError(f"{login!r} is a system account name and cannot have a session")
    return login


def _key_lines(text: str) -> list[str]:
    """The lines of an authorized_keys text that hold a public key (options allowed)."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and _KEY_LINE.search(stripped):
            lines.append(stripped)
    return lines


def _key_readers(
    login: str,
    users: UsersConfig,
    account_of: Callable[[str], Account | None],
) -> list[tuple[Path, Callable[[], str]]]:
    """The files that may hold `login`'s keys, each with how to read it safely."""
    check_login(login)
    readers: list[tuple[Path, Callable[[], str]]] = [
        (source, functools.partial(_read_site_key_file, source))
        for source in (users.keys_dir / f"{login}.pub", users.keys_dir / login / "authorized_keys")
    ]
    if users.host_authorized_keys:
        account = account_of(login)
        if account is not None:
            source = account.home / ".ssh" / "authorized_keys"
            reader = functools.partial(_read_user_key_file, account.home, account.uid)
            readers.append((source, reader))
    return readers


def key_sources(
    login: str,
    users: UsersConfig,
    account_of: Callable[[str], Account | None] = host_account,
) -> list[Path]:
    """The files that may hold `login`'s public keys, in the order they are tried."""
    return [source for source, _ in _key_readers(login, users, account_of)]


class UnsafeKeyFile(OSError):
    """A key file gpuresa refuses to read: not a regular file, too big, or not its user's."""


def _read_capped(descriptor: int, source: Path) -> str:
    """The text of the open regular file `descriptor`; raises `UnsafeKeyFile` past the cap."""
    details = os.fstat(descriptor)
    if not stat.S_ISREG(details.st_mode):
        raise UnsafeKeyFile(f"{source} is not a regular file")
    if details.st_size > MAX_KEY_FILE_SIZE:
        raise UnsafeKeyFile(f"{source} is larger than {MAX_KEY_FILE_SIZE} bytes")
    chunks = []
    size = 0
    # the file may grow after fstat: read no more than the cap, plus one byte to notice
    while size <= MAX_KEY_FILE_SIZE:
        chunk = os.read(descriptor, MAX_KEY_FILE_SIZE + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_KEY_FILE_SIZE:
        raise UnsafeKeyFile(f"{source} is larger than {MAX_KEY_FILE_SIZE} bytes")
    return b"".join(chunks).decode("utf-8", errors="replace")


def _read_site_key_file(source: Path) -> str:
    """A key file of the site's keys_dir (the admin's: links are followed).

    Raises `FileNotFoundError` when it is not there, `UnsafeKeyFile` when it is
    not a regular file or too big, `OSError` when it cannot be read.
    """
    # O_NONBLOCK: opening a FIFO must not wait for a writer
    descriptor = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return _read_capped(descriptor, source)
    finally:
        os.close(descriptor)


def _read_user_key_file(home: Path, owner: int) -> str:
    """`<home>/.ssh/authorized_keys` as the account whose uid is `owner` left it.

    Read by root from a folder the user controls, so no link is followed below
    `home` (neither `.ssh` nor the file), a FIFO or device is refused without
    waiting, the size is capped, and the file must be the user's (or root's,
    when it has no other name a user could have linked it from). Raises
    `FileNotFoundError` when it is not there, `UnsafeKeyFile` when it is
    refused, `OSError` when it cannot be read.
    """
    source = home / ".ssh" / "authorized_keys"
    no_follow = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    opened: list[int] = []
    try:
        try:
            opened.append(os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            opened.append(os.open(".ssh", no_follow | os.O_DIRECTORY, dir_fd=opened[-1]))
            opened.append(os.open("authorized_keys", no_follow, dir_fd=opened[-1]))
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                # O_NOFOLLOW met a link (or a folder was a link or a file)
                raise UnsafeKeyFile(
                    f"{source}: a symbolic link (or a file where a folder belongs) is in its way"
                ) from None
            raise
        details = os.fstat(opened[-1])
        if details.st_uid != owner and not (details.st_uid == 0 and details.st_nlink == 1):
            raise UnsafeKeyFile(f"{source} belongs to uid {details.st_uid}, not to the user")
        return _read_capped(opened[-1], source)
    finally:
        for descriptor in opened:
            os.close(descriptor)


def authorized_keys(
    login: str,
    users: UsersConfig,
    account_of: Callable[[str], Account | None] = host_account,
) -> str:
    """The public keys `login` may log in with, one per line.

    Given: the login and the [users] config; `account_of` looks up host
    accounts (the password database unless a test gives another). Read from
    `<keys_dir>/<login>.pub`, else `<keys_dir>/<login>/authorized_keys`, else
    (when `host_authorized_keys`) the host account's `~/.ssh/authorized_keys`;
    the first file that holds a key wins. A file that is not a regular file,
    is larger than MAX_KEY_FILE_SIZE or (in a home) is a link or not the
    user's is skipped with a warning. Raises `AccessError` when no file holds
    a key: sessions never accept passwords over SSH.
    """
    tried = []
    refused = []
    readers = _key_readers(login, users, account_of)
    for source, read in readers:
        tried.append(str(source))
        try:
            text = read()
        except FileNotFoundError:
            continue
        except UnsafeKeyFile as error:
            log.warning("%s: refusing to read keys: %s", login, error)
            refused.append(str(error))
            continue
        except OSError as error:
            log.warning("%s: cannot read %s: %s", login, source, error.strerror)
            continue
        lines = _key_lines(text)
        if lines:
            log.debug("%s: %d public key(s) from %s", login, len(lines), source)
            return "\n".join(lines) + "\n"
        log.warning("%s: %s holds no public key", login, source)
    why = f"; refused: {'; '.join(refused)}" if refused else ""
    raise AccessError(
        f"no SSH public key for login {login!r} (looked in {', '.join(tried)}{why}); "
        f"put the user's key in {users.keys_dir / (login + '.pub')}"
    )


def container_uid(
    login: str,
    users: UsersConfig,
    account_of: Callable[[str], Account | None] = host_account,
) -> int:
    """The uid `login` has inside its session containers.

    Its entry in `users.uids`, else its uid on this host when it has an
    account there (uid 1000 or more), else a stable number from `users.uid_base`
    up derived from the login, so the same login always gets the same uid.
    Raises `AccessError` when the result does not fit in a remapped uid range.
    """
    check_login(login)
    if login in users.uids:
        uid = users.uids[login]
        origin = "users.uids"
    else:
        account = account_of(login)
        if account is not None and LOWEST_HOST_UID <= account.uid <= HIGHEST_CONTAINER_UID:
            uid = account.uid
            origin = "the host account"
        else:
            digest = hashlib.sha256(login.encode("utf-8")).digest()
            uid = users.uid_base + int.from_bytes(digest[:4], "big") % STABLE_UID_SPAN
            origin = "users.uid_base"
    if not 1 <= uid <= HIGHEST_CONTAINER_UID:
        raise AccessError(
            f"login {login!r} would get uid {uid} (from {origin}), outside the "
            f"1-{HIGHEST_CONTAINER_UID} a user namespace maps; lower users.uid_base or set "
            f"users.uids.{login}"
        )
    return uid


def ftp_credentials(login: str) -> FtpCredentials:
    """Fresh FTP credentials for one session of `login`: its login, a random password.

    The password is 24 URL-safe characters (144 bits), new for every session,
    so one session's password never opens another's output.
    """
    check_login(login)
    return FtpCredentials(user=login, password=secrets.token_urlsafe(18))
