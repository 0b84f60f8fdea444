"""The host folder of a udocker session's tool sockets (see `gpuresa.backends.tool_folders`).

`<udocker root>/tools/<digest of the key>`: the login's, mode 0700, in a folder
of root's that others may traverse but not list or write; bound into the
container at the same path, so that the login's sshd (on the host) and the
tool (in the container) name one file. Short, as a socket's path must be.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from gpuresa.backends.udocker.tools import ensure_folder, udocker_root
from gpuresa.config.sections import Config
from gpuresa.sessions.errors import SessionError

SOCKETS = "tools"


def host_tool_folder(config: Config, key: str) -> Path:
    """The host folder of a udocker session's sockets (short: a socket path has a limit)."""
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return udocker_root(config) / SOCKETS / digest


def make_tool_folder(config: Config, key: str, uid: int, gid: int) -> Path:
    """Make the host folder of a udocker session's sockets afresh: the login's (`uid`,
    `gid`), mode 0700, in a root folder others may traverse but not list or write.

    Raises `SessionError` when it cannot be made.
    """
    folder = host_tool_folder(config, key)
    try:
        ensure_folder(folder.parent, 0o711)
        # what an earlier session of the key left (a crash before its end)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700)
        os.chown(folder, uid, gid)
    except OSError as error:
        raise SessionError(f"cannot make the tools' folder {folder}: {error}") from None
    return folder


def remove_tool_folder(config: Config, key: str) -> None:
    """Remove a udocker session's socket folder (never following links); never raises."""
    shutil.rmtree(host_tool_folder(config, key), ignore_errors=True)
