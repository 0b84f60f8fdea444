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
    """The key's size, SHA-256 fingerprint and type, as `ssh-keygen -l` shows them
    ("256 SHA256:… (ED25519)"), without its comment: that is the login's text, and the
    notice may go to an address from the calendar.

    Raises `subprocess.CalledProcessError` when the text is no public key,
    `subprocess.TimeoutExpired` or `OSError` when `ssh-keygen` cannot tell.
    """
    shown = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", "-"],
        input=public_key, check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    words = (shown.stdout.splitlines() or [""])[0].split()
    if len(words) < 3 or not words[1].startswith("SHA256:") or not words[-1].startswith("("):
        raise subprocess.CalledProcessError(0, "ssh-keygen", shown.stdout)
    return f"{words[0]} {words[1]} {words[-1]}"


def fingerprint_in(path: Path, owner: int) -> str | None:
    """The fingerprint of the public key in `path`, a file of login `owner` (a uid) that the
    login may write.

    None when it cannot be told now (no regular file of the login's own, with one
    link, to read: a symbolic link is not followed, a FIFO not waited on; or
    `ssh-keygen` did not answer); "" when what is there is no public key. What
    the login writes there changes only the notice of the login's own session.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return None
    try:
        details = os.fstat(descriptor)
        # a hard link to another's file is not the login's key
        if not stat.S_ISREG(details.st_mode) or details.st_uid != owner or details.st_nlink != 1:
            return None
        text = os.read(descriptor, _MOST).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)
    try:
        return fingerprint_of(text)
    except subprocess.CalledProcessError:
        return ""
    except (OSError, subprocess.SubprocessError):
        return None
