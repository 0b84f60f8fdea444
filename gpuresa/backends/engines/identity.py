"""This installation's identity: a random id made once in `state_dir`, shown as a label.

Two daemons may share one engine and one host name (a test instance beside the
real one, two admins who both kept the example's `gpu1`). The host label alone
would make each take the other's sessions for orphans and stop them; so every
engine object gpuresa makes also carries `gpuresa.installation`, a digest of
the id kept in `<state_dir>/installation-id`.

Nobody else can choose it: a session's user cannot set labels on engine
objects, and a host user who can label a container is one with the engine's
socket, who is root already. The id itself never leaves the state folder (the
label is a digest of it), so it can later serve as a secret of the
installation too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
from pathlib import Path

from gpuresa.sessions.errors import SessionError

ID_FILE = "installation-id"
# 96 bits of the digest: two installations never meet by chance
LABEL_DIGITS = 24
_ID_PATTERN = re.compile(r"[0-9a-f]{64}")


def installation_label(state_dir: Path) -> str:
    """The value of this installation's `gpuresa.installation` label.

    Reads `<state_dir>/installation-id`, making it (and `state_dir`) when it is
    not there; two processes that make it at once agree on one id. Raises
    `SessionError` when the file cannot be made, is not root's own (or ours)
    and private, or does not hold an id gpuresa wrote.
    """
    path = state_dir / ID_FILE
    try:
        text = _read(path)
    except FileNotFoundError:
        text = _make(path)
    except OSError as error:
        raise SessionError(f"cannot read the installation id {path}: {error}") from None
    if _ID_PATTERN.fullmatch(text) is None:
        raise SessionError(
            f"{path} does not hold an installation id; restore it from a backup (the engine "
            "objects of this installation carry its digest), or remove it to start anew"
        )
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:LABEL_DIGITS]


def _read(path: Path) -> str:
    """The id in `path`, once it is shown to be this user's and private."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "r", encoding="ascii", errors="replace") as file:
        details = os.fstat(file.fileno())
        # anyone who could write it could make this daemon take their objects for its own
        if details.st_uid != os.geteuid() or details.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise SessionError(
                f"{path} must be owned by uid {os.geteuid()} and writable by it alone"
            )
        return file.read(200).strip()


def _make(path: Path) -> str:
    """Write a new id in `path` atomically; the id that is there if another process won."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{ID_FILE}.{secrets.token_hex(8)}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w", encoding="ascii") as file:
                file.write(secrets.token_hex(32) + "\n")
                file.flush()
                os.fsync(file.fileno())
            # a link never replaces a file: the first process to link gives the id to all
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        return _read(path)
    except OSError as error:
        raise SessionError(f"cannot make the installation id {path}: {error}") from None
