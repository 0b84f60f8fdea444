"""What a udocker host must have, and what a session of a login gets on it.

Sessions run as their login's own account, so the account is checked before
anything is made (no account: refused; a system account: refused), and the
session's output folder is the login's own from the start (the hand-over at
the end makes it root's and read-only to the login, as on the engines).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from gpuresa.access import LOWEST_HOST_UID, AccessError, Account, host_account
from gpuresa.config.sections import Config
from gpuresa.model import SessionSpec
from gpuresa.outputs.folder import OUTPUT_MODE, output_path
from gpuresa.outputs.owners import output_owner, prepare_login_folder
from gpuresa.sessions.errors import SessionError


def check_host(config: Config, root: Path, cgroup_root: Path) -> None:
    """Refuse a host where sessions could not be confined: no runc, python3 or cgroups, a
    udocker folder `root` users cannot reach, or no util-linux tools."""
    udocker = config.udocker
    for path, what in ((udocker.runc, "runc"), (udocker.python, "python")):
        if not os.access(path, os.X_OK):
            raise SessionError(f"udocker.{what}: {path} is not an executable")
    for name in ("pids", "memory", "cpu", "freezer"):
        if not (cgroup_root / name / "cgroup.procs").exists():
            raise SessionError(
                f"the host has no cgroup v1 {name} controller at {cgroup_root / name}: "
                "udocker sessions could not be stopped or limited"
            )
    for folder in [root, *root.parents]:
        with contextlib.suppress(FileNotFoundError):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                raise SessionError(
                    f"{folder} is not traversable by users: their udocker and sshd could not "
                    f"reach {root} (set [udocker] root elsewhere)"
                )
    for tool in ("setpriv", "setsid", "nsenter"):
        if shutil.which(tool) is None:
            raise SessionError(f"{tool} (util-linux) is not installed")


def session_account(spec: SessionSpec) -> Account:
    """The login's host account; `SessionError` when it has none (sessions run as it)."""
    account = host_account(spec.user)
    if account is None:
        raise SessionError(
            f"session {spec.key}: login {spec.user!r} has no account on host "
            f"{spec.host}: udocker sessions run as the user's own account"
        )
    if account.uid < LOWEST_HOST_UID:
        # a system account (root, a database's, a daemon's): no booking runs as it
        raise SessionError(
            f"session {spec.key}: login {spec.user!r} is a system account on host "
            f"{spec.host} (uid {account.uid}, below {LOWEST_HOST_UID})"
        )
    return account


def login_output(config: Config, spec: SessionSpec, account: Account) -> Path:
    """The session's output folder at its final place, the login's own from the start."""
    final = output_path(config, spec)
    try:
        owner = output_owner(spec.user, config)
        prepare_login_folder(config, owner)
        # the login's folder is root's with the login's group (0750): the login passes
        final.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        final.mkdir(mode=OUTPUT_MODE, exist_ok=True)
        if final.is_symlink() or not final.is_dir():
            raise SessionError(f"output folder {final} is not a folder")
        os.lchown(final, account.uid, account.gid)
    except (AccessError, OSError) as error:
        raise SessionError(f"cannot make output folder {final}: {error}") from None
    return final
