"""Throw-away host accounts for tests, and commands run as one of them."""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator


@contextlib.contextmanager
def throwaway_account(prefix: str) -> Iterator[int]:
    """A host account with no home (removed afterwards): its uid."""
    login = f"{prefix}{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", login], check=True)
    try:
        yield int(subprocess.run(["id", "-u", login], capture_output=True, text=True).stdout)
    finally:
        subprocess.run(["userdel", login], check=False)


def kill_processes(login: str) -> None:
    """Kill every process of `login` (a spare container's maker, a removal left detached)
    and wait until none is left: one still writing would refill a folder being removed,
    and `userdel` refuses an account a process runs as."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = False
        for which in ("-U", "-u"):  # its real or its effective uid
            subprocess.run(["pkill", "-KILL", which, login], check=False)
            found = subprocess.run(["pgrep", which, login], capture_output=True)
            left = left or found.returncode == 0
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of {login} outlived SIGKILL for 15 s")


def remove_account(login: str, *, home: bool = True) -> None:
    """Remove `login`'s account (and its home) once none of its processes is left; raises
    when it stays."""
    kill_processes(login)
    removed = subprocess.run(
        ["userdel", *(["--remove"] if home else []), login], capture_output=True, text=True
    )
    # 12: the home could not be removed (gone already); the account itself is
    if removed.returncode not in (0, 12):
        raise AssertionError(f"account {login} not removed: {removed.stderr.strip()}")


def as_uid(uid: int, *command: str) -> str:
    """What `command` prints (stdout then stderr) run as host uid `uid`, no privileges."""
    result = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return (result.stdout + result.stderr).strip()
