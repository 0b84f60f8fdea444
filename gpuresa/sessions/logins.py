"""Whether a session's logs show a login of its user: what "used" means for a no-show.

A session's sshd (run with `-e` or `-E`) logs "Accepted <method> for <login>
from <address> port <n> …" once a login is let in, SSH and SFTP alike; the
FTP sidecar's vsftpd logs "[<login>] OK LOGIN". Only whole lines in those
forms count, from their start: sshd writes a name a client sent in the middle
of its own lines ("Invalid user <name> from …"), so a name made to look like
an "Accepted" line never starts one. Pure, for every backend.
"""

from __future__ import annotations

import re

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
