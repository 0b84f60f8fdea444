"""Whether a session's logs show a login of its user: what "used" means for a no-show.

A session's sshd (run with `-e` or `-E`) logs "Accepted <method> for <login>
from <address> port <n> …" once a login is let in, SSH and SFTP alike; the
FTP sidecar's vsftpd logs "[<login>] OK LOGIN". Only whole lines in those
forms count, from their start: sshd writes a name a client sent in the middle
of its own lines ("Invalid user <name> from …"), so a name made to look like
an "Accepted" line never starts one. Pure, for every backend, but for
`read_log`, which reads a log a login may have replaced.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

# sshd -e writes bare lines; -E prefixes a syslog-style date and "sshd[pid]: "
_SSHD_ACCEPTED = re.compile(
    r"^(?:\w{3} [ \d]\d [\d:]{8} \S+ sshd\[\d+\]: )?"
    r"Accepted [\w/-]+ for (?P<login>[a-z_][a-z0-9_-]*) from \S+ port \d+",
    re.MULTILINE,
)
# vsftpd with xferlog_std_format=NO: "<date> [pid <n>] [<login>] OK LOGIN: Client …"
_FTP_OK_LOGIN = re.compile(
    r"^\w{3} \w{3} [ \d]\d [\d:]{8} \d{4} \[pid \d+\] \[(?P<login>[a-z_][a-z0-9_-]*)\] OK LOGIN:",
    re.MULTILINE,
)


def ssh_login_seen(log_text: str, login: str) -> bool:
    """Whether sshd's log `log_text` shows `login` let in."""
    return any(match["login"] == login for match in _SSHD_ACCEPTED.finditer(log_text))


def ftp_login_seen(log_text: str, login: str) -> bool:
    """Whether vsftpd's log `log_text` shows `login` let in."""
    return any(match["login"] == login for match in _FTP_OK_LOGIN.finditer(log_text))


# how much of a log is read: a session's sshd writes a few lines per connection
LOG_LIMIT = 4 * 1024 * 1024


def read_log(path: Path) -> str | None:
    """The first `LOG_LIMIT` bytes of the log file at `path`; None when it is not a regular
    file or cannot be opened. A login that owns the folder or the file (udocker's, a
    Slurm job's) may have put a link, a FIFO or a device there, or grown the file: no
    link is followed, nothing waits on a FIFO, and the read is bounded."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        chunks: list[bytes] = []
        left = LOG_LIMIT
        while left > 0:
            chunk = os.read(descriptor, min(left, 1024 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)
