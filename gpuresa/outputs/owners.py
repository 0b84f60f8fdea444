"""Who may read a finished session's output on the host, and how a login's folder is laid out.

During a session its output belongs to the container's remapped uid (Docker
`userns-remap`; other engines give other ranges), or on udocker and Slurm to
the login's own account. At the stop it is handed over READ-ONLY: every
folder and file becomes root's (`HANDED_UID`), readable through one group per
login (folders and programs 0750, files 0640). Nobody but root can write
there any more, so a session's cap is final and nobody fills the output disk
after the end; the retention removes outputs (their users cannot).

The reader is one stable account per login, so the output service serves
every output of a login under one account whatever engine wrote it:

- the login's host account, when it has one and `storage.hand_output_to_user`,
  and the group is its primary group when that group is private to it (no other
  account has it, as primary or supplementary group): the login reads its
  outputs from its host shell too;
- else uid and group `storage.output_uid_base + container_uid(login)`, ids no
  host account and no remapped range uses (checked against /etc/subuid by
  `uid_overlaps`): only the output service (whose account for the login has
  them) reads the outputs. A shared primary group ("users") is never used: its
  members would read each other's outputs.

`<output_root>/<login>` is the login's chroot in the output service: root's,
mode 0750, group the owner's group, so sshd accepts it as a chroot, the login
can list it, and nobody else on the host can.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuresa.access import AccessError, Account, check_login, container_uid, host_account
from gpuresa.config.sections import Config

log = logging.getLogger(__name__)

LOGIN_FOLDER_MODE = 0o750
ROOT_MODE = 0o755
# who owns every handed-over folder and file: no host user may write there
HANDED_UID = 0


@dataclass(frozen=True)
class Owner:
    """The reader of a login's finished outputs: its uid and the group the outputs have.

    The outputs themselves are `HANDED_UID`'s; `uid` is the account that reads
    them through `gid` (the login's host account, or the output service's).
    """

    login: str
    uid: int
    gid: int
    host_account: bool


def private_group(account: Account) -> bool:
    """Whether `account`'s primary group is its alone: no other account has it.

    Neither as primary group (the password database) nor as supplementary
    group (the group's members); an unknown group is not private.
    """
    try:
        members = grp.getgrgid(account.gid).gr_mem
    except KeyError:
        return False
    if any(member != account.login for member in members):
        return False
    return all(
        entry.pw_name == account.login or entry.pw_gid != account.gid for entry in pwd.getpwall()
    )


def output_owner(
    login: str, config: Config, account_of: Callable[[str], Account | None] = host_account
) -> Owner:
    """The stable reader of `login`'s finished outputs (see the module docstring).

    Raises `AccessError` for a login that may not have sessions.
    """
    check_login(login)
    derived = config.storage.output_uid_base + container_uid(login, config.users, account_of)
    account = account_of(login) if config.storage.hand_output_to_user else None
    if account is not None and account.uid != 0:
        gid = account.gid if private_group(account) else derived
        return Owner(login, account.uid, gid, True)
    return Owner(login, derived, derived, False)


def uid_overlaps(config: Config, subordinate: str | None = None) -> list[str]:
    """Ranges of /etc/subuid (text given, else read) that derived owners could fall into."""
    if subordinate is None:
        try:
            subordinate = Path("/etc/subuid").read_text()
        except OSError:
            return []
    first = config.storage.output_uid_base
    last = first + 65535
    problems = []
    for line in subordinate.splitlines():
        name, _, rest = line.partition(":")
        start_text, _, count_text = rest.partition(":")
        if not (start_text.isdigit() and count_text.isdigit()):
            continue
        start, count = int(start_text), int(count_text)
        if start <= last and first < start + count:
            problems.append(f"{name}:{start}:{count}")
    return problems


def login_folder(config: Config, login: str) -> Path:
    """`<output_root>/<login>`: the folder holding every output of `login`."""
    return config.storage.output_root / check_login(login)


def prepare_root(config: Config) -> None:
    """Make the output root (root's, 0755: each login folder below guards itself)."""
    root = config.storage.output_root
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, ROOT_MODE)


def prepare_login_folder(config: Config, owner: Owner) -> Path:
    """Make `<output_root>/<login>` root's with the owner's group, mode 0750; returns it.

    Raises `AccessError` when it is a link or not a folder (never chroot through one).
    """
    prepare_root(config)
    folder = login_folder(config, owner.login)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=LOGIN_FOLDER_MODE)
    details = folder.lstat()
    if not stat.S_ISDIR(details.st_mode):
        raise AccessError(
            f"{folder} is not a folder (a link?); outputs of {owner.login} not served"
        )
    if (details.st_uid, details.st_gid) != (0, owner.gid):
        os.lchown(folder, 0, owner.gid)
    if stat.S_IMODE(details.st_mode) != LOGIN_FOLDER_MODE:
        os.chmod(folder, LOGIN_FOLDER_MODE)
    return folder
