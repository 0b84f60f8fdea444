"""The fingerprint of a session's own SSH host key, for its start notice.

Sessions whose sshd runs as the login (udocker's, a Slurm job's) present a key
of their own, not one certified by the host CA; the notice names its SHA-256
fingerprint, as `ssh` shows it when it asks.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

# an ed25519 or RSA public key line is well under this
_MOST = 16384


def fingerprint_of(public_key: str) -> str:
    """`ssh-keygen -l`'s SHA-256 line for a public key given as text.

    Raises `subprocess.CalledProcessError` when the text is no public key.
    """
    shown = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", "-"],
        input=public_key, check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return shown.stdout.strip()


def fingerprint_in(path: Path) -> str | None:
    """The fingerprint of the public key in `path`, a file the login may write.

    None when there is no regular file to read (a link is not followed, a FIFO
    not waited on); "" when what is there is no public key. What the login
    writes there changes only the notice of the login's own session.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        text = os.read(descriptor, _MOST).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)
    try:
        return fingerprint_of(text)
    except (OSError, subprocess.SubprocessError):
        return ""
