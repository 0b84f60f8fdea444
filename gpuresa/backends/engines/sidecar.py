"""An FTP sidecar that went away while its session's main container runs: brought back alone.

The user's container, and the work running in it, is never touched for
this: an exited sidecar is started again; a removed one is created again from
the main container's labels (same ports, same output folder, a new FTP
password: the daemon sees the changed password and sends the new details).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpuresa.access import AccessError, ftp_credentials
from gpuresa.backends.engines.create_payloads import ftp_payload
from gpuresa.backends.engines.engine import dumps
from gpuresa.backends.engines.host_sessions import HostSessions
from gpuresa.backends.engines.lookup import container_name, status
from gpuresa.backends.engines.probes import ftp_greeting
from gpuresa.model import IdRange
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.running_area import running_path
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import FTP_PASSWORD_FILE
from gpuresa.sessions.labels import ROLE_LABEL, ftp_name, session_from_labels

log = logging.getLogger(__name__)


def revive_sidecar(sessions: HostSessions, key: str, deadline: float) -> bool:
    """Bring back the FTP sidecar of session `key` alone, if only the sidecar is down.

    Given this host's sessions and a `time.monotonic()` deadline for the FTP server to
    greet. Returns False (and does nothing) unless the main container runs and
    the sidecar is missing or not running; True once the sidecar greets.
    Raises `SessionError` (`ImageMissing`, `PortRefused`…) when it cannot be
    brought back: the main container is left running all the same.
    """
    found = sessions.find(key)
    if status(found.main) != "running" or status(found.ftp) == "running":
        return False
    assert found.main is not None
    if found.ftp is None:
        log.warning("%s: the FTP sidecar is gone; making it again", key)
        name = _recreate(sessions, key, found.main)
    else:
        log.warning("%s: the FTP sidecar had exited; starting it again", key)
        name = container_name(found.ftp)
    sessions.engine.start_container(name, key)
    port = int(found.main["Config"]["Labels"]["gpuresa.ftp-port"])
    address = sessions.probe_address()
    while time.monotonic() < deadline:
        if ftp_greeting(address, port, 2.0):
            return True
        time.sleep(0.1)
    raise SessionError(f"session {key}: the restarted FTP server does not answer")


def _recreate(sessions: HostSessions, key: str, main: dict[str, Any]) -> str:
    """Create the sidecar again from the main container's labels; returns its name."""
    labels = {name: value for name, value in main["Config"]["Labels"].items() if name != ROLE_LABEL}
    try:
        session = session_from_labels(labels, "running", ())
        credentials = ftp_credentials(session.user)
    except (KeyError, ValueError, AccessError) as error:
        raise SessionError(f"session {key}: cannot make its FTP sidecar again: {error}") from None
    ids = sessions.kind.session_range(sessions.engine, main)
    spec = session.spec
    payload = ftp_payload(
        sessions.config,
        spec,
        sessions.images.require_ftp_image(),
        int(labels["gpuresa.uid"]),
        session.ftp_user or credentials.user,
        credentials.password,
        # the running place, root-only and nosuid (see outputs.running_area), as at the start
        running_path(sessions.config, key),
        labels,
        sessions.announced_address(key),
        # the same host ids as the user's container (Podman: that session's own range)
        sessions.kind.sidecar_settings(ids, sessions.config.limits),
        tls_dir=HostCredentials(sessions.config).sidecar_tls(*_base(ids)),
    )
    uid, (base_uid, base_gid) = int(labels["gpuresa.uid"]), _base(ids)
    sessions.files.show_secret(
        key, FTP_PASSWORD_FILE, credentials.password + "\n", base_uid + uid, base_gid + uid
    )
    log.debug("%s: FTP sidecar %s", key, dumps(payload))
    name = ftp_name(session.host, key)
    sessions.engine.create_container(name, payload, key)
    return name


def _base(ids: IdRange | None) -> tuple[int, int]:
    """The host uid and gid of root in the session's containers (0, 0 without a range)."""
    return (ids.uid, ids.gid) if ids is not None else (0, 0)
