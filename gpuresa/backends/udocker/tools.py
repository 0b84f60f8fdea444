"""udocker as gpuresa runs it: as the booking user, offline, in runc mode, per-user repositories.

Each login has its own udocker repository, `<repositories>/<login>` (mode 0700,
the user's): images are loaded there, each session's container is made there.
Every udocker command runs as the user (`setpriv`), with the site's python3
(`[udocker] python`) and only udocker on its path, with `UDOCKER_TARBALL`
empty (udocker never downloads its tools) and the host's runc.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import udocker

from gpuresa.access import Account
from gpuresa.config.sections import Config
from gpuresa.sessions.errors import EngineTimeout, SessionError

log = logging.getLogger(__name__)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# where udocker's package lives: the users' python3 gets this (and nothing else of ours)
UDOCKER_PATH = Path(udocker.__file__).resolve().parent.parent
COMMAND_TIMEOUT = 120.0


def udocker_root(config: Config) -> Path:
    """gpuresa's udocker folder (sessions, their files, image archives, driver files):
    `[udocker] root`, else `<state_dir>-udocker`. Not inside the state folder, which is
    root's alone: each login's runc and sshd reach their session's files through it."""
    state = config.daemon.state_dir
    return config.udocker.root or state.parent / f"{state.name}-udocker"


def repository(config: Config, login: str) -> Path:
    """The login's udocker repository."""
    base = config.udocker.repositories or udocker_root(config) / "users"
    return base / login


def ensure_folder(path: Path, mode: int = 0o755) -> None:
    """Make `path` root's with `mode` (and its parents); refuses a link."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    if path.is_symlink():
        raise SessionError(f"{path} is a symbolic link; refusing to use it")
    os.chown(path, 0, 0)
    os.chmod(path, mode)


def ensure_repository(config: Config, account: Account) -> Path:
    """The login's repository, made (the user's, mode 0700) when missing."""
    ensure_folder(repository(config, account.login).parent)
    path = repository(config, account.login)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        if path.is_symlink() or not path.is_dir():
            raise SessionError(f"udocker repository {path} is not a folder")
        os.chown(path, account.uid, account.gid)
    except OSError as error:
        raise SessionError(f"cannot make the udocker repository {path}: {error}") from None
    return path


def environment(config: Config, account: Account, extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The clean environment udocker runs in for `account`."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(account.home),
        "USER": account.login,
        "LOGNAME": account.login,
        "LANG": "C.UTF-8",
        "UDOCKER_DIR": str(repository(config, account.login)),
        "UDOCKER_TARBALL": "",
        "UDOCKER_DEFAULT_EXECUTION_MODE": "R1",
        "UDOCKER_USE_RUNC_EXECUTABLE": str(config.udocker.runc),
        "PYTHONPATH": str(UDOCKER_PATH),
        "PYTHONDONTWRITEBYTECODE": "1",
        **extra,
    }


def as_user(account: Account, command: Sequence[str]) -> list[str]:
    """`command` run as `account` (its uid, gid and groups), with no environment of ours."""
    return [
        "setpriv",
        f"--reuid={account.uid}",
        f"--regid={account.gid}",
        "--init-groups",
        "--",
        *command,
    ]


def udocker_command(config: Config, arguments: Sequence[str]) -> list[str]:
    """The command line of `udocker ARGUMENTS` through gpuresa's launcher: `-s`, so that no
    `.pth` file the user put in their own site-packages runs in what gpuresa starts."""
    return [str(config.udocker.python), "-s", str(SCRIPTS / "launcher.py"), *arguments]


def run_udocker(
    config: Config,
    account: Account,
    arguments: Sequence[str],
    key: str,
    timeout: float = COMMAND_TIMEOUT,
) -> str:
    """Run `udocker ARGUMENTS` as the user; its output. Raises `SessionError` on failure."""
    command = as_user(account, udocker_command(config, arguments))
    try:
        result = subprocess.run(
            command,
            env=environment(config, account),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise EngineTimeout(f"{key}: udocker {arguments[0]} took over {timeout:.0f} s") from None
    except OSError as error:
        raise SessionError(f"{key}: cannot run udocker: {error}") from None
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()[-600:]
        raise SessionError(f"{key}: udocker {arguments[0]} failed: {output}")
    return result.stdout


def archive_name(archive: Path) -> str:
    """The image name (repository:tag) an image archive holds; raises `SessionError`."""
    try:
        with tarfile.open(archive) as tar:
            member = tar.extractfile("manifest.json")
            manifest = json.load(member) if member else []
            tags = manifest[0].get("RepoTags") or []
    except (OSError, tarfile.TarError, KeyError, ValueError, IndexError) as error:
        raise SessionError(f"image archive {archive} is not readable: {error}") from None
    if not tags:
        raise SessionError(f"image archive {archive} names no image (save it with its tag)")
    return str(tags[0])


def image_loaded(config: Config, login: str, name: str) -> bool:
    """Whether `name` (repository:tag) is in the login's repository; never waits."""
    repo, _, tag = name.rpartition(":")
    return (repository(config, login) / "repos" / repo / tag).is_dir()


def start_detached(
    config: Config, account: Account, command: Sequence[str], key: str, what: str
) -> None:
    """Start `command` as the user, detached (its own session, nobody waits for it); logs
    "`what` failed" and never raises when it cannot be started."""
    try:
        subprocess.run(
            ["setsid", "-f", *as_user(account, command)],
            env=environment(config, account),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("%s: %s failed: %s", key, what, error)


def remove_detached(config: Config, account: Account, container: str, key: str) -> None:
    """Start `udocker rm` of `container` as the user, detached; logs, never raises."""
    command = udocker_command(config, ["rm", "-f", container])
    start_detached(config, account, command, key, f"removing container {container}")
