"""Which browser tools a session offers and how its user reaches them, from its template.

Given where the session's sockets are, as its sshd sees them (each backend
knows its own: `gpuresa.sessions.tools.SESSION_SOCKETS` in an engine's
container, a host folder of the login's on udocker), this reads the template's
`[[tools]]` and the daemon's secret, and writes the session's tool files
(`show_tools`) or gives the lines of the start e-mail (`session_tools`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import PurePosixPath

from gpuresa.config.sections import Config
from gpuresa.model import SessionSpec
from gpuresa.reservations import catalog
from gpuresa.reservations.template_tools import Tool
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import SessionFiles
from gpuresa.sessions.tools import (
    ToolAccess,
    daemon_secret,
    reachable,
    tool_token,
    write_session_tools,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionTools:
    """A session's reachable tools and how its user reaches them."""

    tools: tuple[Tool, ...]
    access: ToolAccess


def session_tools(
    config: Config,
    folder: PurePosixPath,
    *,
    key: str,
    login: str,
    template: str,
    ssh_port: int,
    public_host: str,
) -> SessionTools | None:
    """The tools of session `key`, whose sockets are in `folder` (None when it has none).

    Reads the template's declaration and the daemon's secret; raises `OSError`
    when the secret cannot be read or made.
    """
    declared = catalog.load_templates(config).get(template)
    if declared is None:
        return None
    tools = reachable(declared.tools, folder)
    if len(tools) < len(declared.tools):
        log.warning("%s: a tool's socket path in %s is too long; left out", key, folder)
    if not tools:
        return None
    token = tool_token(daemon_secret(config.daemon.state_dir), key, login)
    return SessionTools(tools, ToolAccess(login, public_host, ssh_port, folder, token))


def public_host(config: Config) -> str:
    """The name users connect to: this host's `public_name`, else its name."""
    host = config.host()
    return host.public_name or host.name


def show_tools(
    config: Config,
    files: SessionFiles,
    spec: SessionSpec,
    folder: PurePosixPath,
    owner: tuple[int, int],
) -> None:
    """Write the tools' files of session `spec` (`write_session_tools`), its sockets in
    `folder`, for the host ids `owner` of its login; nothing for a session without tools.

    Raises `SessionError` when the token or the files cannot be made.
    """
    try:
        found = session_tools(
            config,
            folder,
            key=spec.key,
            login=spec.user,
            template=spec.template,
            ssh_port=spec.ssh_port,
            public_host=public_host(config),
        )
    except OSError as error:
        raise SessionError(f"the token of its tools cannot be made: {error}") from None
    if found is not None:
        write_session_tools(files, spec.key, found.tools, found.access, owner)
