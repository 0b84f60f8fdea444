"""Whether a Docker or Podman session was used: its sshd's log, then its FTP server's.

The session's sshd runs with `-e` (templates/access): what it logs is the
main container's log, which nothing in the session writes before a login
(the container's root is reached through a login only). The FTP sidecar's
vsftpd writes its own log file inside the sidecar, which the session cannot
reach at all. Both are read whole: a session's logs are a few lines per
connection, and only sessions awaiting their first login are asked.
"""

from __future__ import annotations

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.lookup import Found, container_name
from gpuresa.sessions.logins import ftp_login_seen, ssh_login_seen

# where the FTP sidecar's vsftpd logs (templates/ftp/vsftpd.conf)
FTP_LOG = "/var/log/gpuresa/vsftpd.log"


def session_used(engine: Engine, found: Found, login: str, key: str) -> bool:
    """Whether the session (its containers `found`) let `login` in by SSH, SFTP or FTP."""
    if found.main is not None and ssh_login_seen(
        engine.logs(container_name(found.main), lines=None), login
    ):
        return True
    if found.ftp is not None:
        text = engine.read_file(container_name(found.ftp), FTP_LOG, key)
        if text is not None and ftp_login_seen(text.decode(errors="replace"), login):
            return True
    return False
