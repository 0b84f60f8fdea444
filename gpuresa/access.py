"""Who may get into a session, and how: logins, SSH keys, uids, FTP credentials.

Pure lookups on the host's files; nothing here talks to Docker. The runtime
asks these questions before it creates anything, so a booking with a bad login
or no key is refused with a reason and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import logging
import pwd
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuresa.config import LOGIN, UsersConfig
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


def key_sources(
    login: str,
    users: UsersConfig,
    account_of: Callable[[str], Account | None] = host_account,
) -> list[Path]:
    """The files that may hold `login`'s public keys, in the order they are tried."""
    check_login(login)
    sources = [users.keys_dir / f"{login}.pub", users.keys_dir / login / "authorized_keys"]
    if users.host_authorized_keys:
        account = account_of(login)
        if account is not None:
            sources.append(account.home / ".ssh" / "authorized_keys")
    return sources


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
    the first file that holds a key wins. Raises `AccessError` when none does:
    sessions never accept passwords over SSH.
    """
    tried = []
    for source in key_sources(login, users, account_of):
        tried.append(str(source))
        try:
            text = source.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        except OSError as error:
            log.warning("%s: cannot read %s: %s", login, source, error.strerror)
            continue
        lines = _key_lines(text)
        if lines:
            log.debug("%s: %d public key(s) from %s", login, len(lines), source)
            return "\n".join(lines) + "\n"
        log.warning("%s: %s holds no public key", login, source)
    raise AccessError(
        f"no SSH public key for login {login!r} (looked in {', '.join(tried)}); "
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
