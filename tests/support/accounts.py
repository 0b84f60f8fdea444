"""Throw-away host accounts for tests, and commands run as one of them."""

from __future__ import annotations

import contextlib
import subprocess
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


def as_uid(uid: int, *command: str) -> str:
    """What `command` prints (stdout then stderr) run as host uid `uid`, no privileges."""
    result = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return (result.stdout + result.stderr).strip()
