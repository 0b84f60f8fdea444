"""Whether a Docker or Podman session was used: its sshd's log, then its FTP server's.

The session's sshd runs with `-e` (templates/access): what it logs is the
main container's log, which nothing in the session writes before a login
(the container's root is reached through a login only). The FTP sidecar's
vsftpd writes its own log file inside the sidecar, which the session cannot
reach at all. Both are read whole: a session's logs are a few lines per
connection, and only sessions awaiting their first login are asked. Anyone
can fill the log with refused connections until the engine empties it (10 MB,
`create_payloads`): a log that no longer starts with the session's first line
tells nothing, so such a flood can keep a session from being released, never
get a used one released.
"""

from __future__ import annotations

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.lookup import Found, container_name
from gpuresa.sessions.logins import ftp_login_seen, ssh_login_seen

# where the FTP sidecar's vsftpd logs (templates/ftp/vsftpd.conf)
FTP_LOG = "/var/log/gpuresa/vsftpd.log"
# what the session's entrypoint writes first, before its sshd (templates/access): a log
# without it was emptied or rotated since
START_MARK = "gpuresa entrypoint: session "


def session_used(engine: Engine, found: Found, login: str, key: str) -> bool | None:
    """Whether the session (its containers `found`) let `login` in by SSH, SFTP or FTP;
    None when its log no longer reaches back to the container's start (the engine caps a
    log: Podman's conmon empties it, Docker drops its oldest file), so a login may have
    been lost. Raises what the engine raises: a check that fails tells nothing."""
    if found.main is not None:
        text = engine.logs(container_name(found.main), lines=None, strict=True)
        if ssh_login_seen(text, login):
            return True
        if START_MARK not in text:
            return None
    if found.ftp is not None:
        data = engine.read_file(container_name(found.ftp), FTP_LOG, key)
        if data is not None and ftp_login_seen(data.decode(errors="replace"), login):
            return True
    return False
