"""The start e-mail's lines of a session's browser tools, wherever its backend keeps them.

Where the sockets are is a capability of the session's backend
(`Capabilities.tool_sockets`): in the session ("session": Docker, Podman), in
a host folder of the login's ("host": udocker), or nowhere ("none": no tools).
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath

from gpuresa.backends.udocker.sockets import host_tool_folder
from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.model import Session
from gpuresa.sessions.tool_access import session_tools
from gpuresa.sessions.tools import SESSION_SOCKETS, tools_text

log = logging.getLogger(__name__)


def tool_folder(config: Config, host: str, key: str) -> PurePosixPath | None:
    """Where session `key` of `host` has its sockets, as its sshd sees them; None when its
    backend starts no tools (or the host is not configured here)."""
    try:
        where = host_capabilities(config.host(host)).tool_sockets
    except UserError:
        return None
    if where == "session":
        return SESSION_SOCKETS
    if where == "host":
        return PurePosixPath(host_tool_folder(config, key))
    return None


def start_tool_lines(config: Config, session: Session, public_host: str) -> str:
    """Each tool's `ssh -L` line and URL (with the session's token) for the start e-mail;
    empty without tools, or when the token's secret cannot be read (logged)."""
    folder = tool_folder(config, session.host, session.key)
    if folder is None:
        return ""
    try:
        found = session_tools(
            config,
            folder,
            key=session.key,
            login=session.user,
            template=session.template,
            ssh_port=session.ssh_port,
            public_host=public_host,
        )
    except OSError as error:
        log.error("%s: tools left out of the start notice: %s", session.key, error)
        return ""
    return "" if found is None else tools_text(found.tools, found.access)
