"""A session's browser tools (JupyterLab…): their token, their sockets, what the user is told.

SSH stays the only way in. A tool listens on a unix socket in a folder only the
session's login can enter (or on a TCP port inside the session, as DIGITS's
page does), and its user reaches it with one `ssh -L` line: no port of the
host's is published, and on a backend whose sessions share the host's network
(udocker) nothing listens on the host's loopback, which every host user reaches.

The token. A tool on a socket asks for a token, derived per session as
HMAC-SHA256(secret, key, login), with a secret that only the daemon (root)
reads: `<state_dir>/tool-secret`, made once. Derived rather than drawn and
stored: the same token comes back whenever the daemon writes the login
message again (the end moved), sends the start e-mail again or restarts, with
nothing per session to keep, clean up or lose; one session's token tells
nothing about another's, and a new login on the booking gets a new one. It
reaches the booking user only: their start e-mail, and two files of the
session's folder (`tools`, the login message's lines, and `tool-token`, what
the tool reads) that belong to the login's uid with mode 0400. The socket's
folder already keeps other host users out (a token alone is not enough where
they could connect); the token keeps out whatever else runs in the session's
network or as another user there.

Pure functions make the token and the texts; `write_session_tools` and
`daemon_secret` are the I/O at the edge.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpuresa.inert import inert_lines
from gpuresa.reservations.template_tools import Tool
from gpuresa.sessions.files import SessionFiles

SECRET_FILE = "tool-secret"
SECRET_BYTES = 32
# in the session's folder (mounted at /etc/gpuresa/session): the token the tools read,
# the login message's lines, and each started tool's command (its arguments, NUL-ended)
TOKEN_FILE = "tool-token"
TEXT_FILE = "tools"
COMMAND_FILE = "tool-{name}.command"
# where a session with its own filesystem and sshd keeps the sockets (made by the
# access layer's entrypoint, the login's, mode 0700)
SESSION_SOCKETS = PurePosixPath("/run/gpuresa-tools")
# a unix socket's path is at most 107 bytes (sun_path, with its NUL)
SOCKET_PATH_LIMIT = 107


def tool_token(secret: bytes, key: str, login: str) -> str:
    """The token of session `key` for `login` (48 hex digits: 192 bits)."""
    message = f"gpuresa-tool-token\0{key}\0{login}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:48]


def socket_path(folder: PurePosixPath, tool: Tool) -> PurePosixPath:
    """Where `tool` listens when the session's sockets are in `folder`."""
    return folder / f"{tool.name}.sock"


def reachable(tools: Sequence[Tool], folder: PurePosixPath | None) -> tuple[Tool, ...]:
    """The tools a session offers: with no socket `folder` (a backend that starts no
    tools) none; a socket whose path would be too long for a unix socket is left out."""
    if folder is None:
        return ()
    return tuple(
        tool
        for tool in tools
        if not tool.socket or len(str(socket_path(folder, tool)).encode()) <= SOCKET_PATH_LIMIT
    )


@dataclass(frozen=True)
class ToolAccess:
    """How a session's user reaches its tools: the SSH login, the sockets' folder as the
    session's sshd sees it, and the session's token."""

    login: str
    host: str
    ssh_port: int
    folder: PurePosixPath
    token: str


def forward_line(tool: Tool, access: ToolAccess) -> str:
    """The one `ssh -L` line that brings `tool` to the user's `localhost:<local_port>`."""
    target = str(socket_path(access.folder, tool)) if tool.socket else f"localhost:{tool.port}"
    return f"ssh -p {access.ssh_port} -L {tool.local_port}:{target} {access.login}@{access.host}"


def tool_url(tool: Tool, access: ToolAccess) -> str:
    """The URL to open once forwarded, with the token where the tool asks for one."""
    url = f"http://localhost:{tool.local_port}{tool.path}"
    return f"{url}?token={access.token}" if tool.token else url


def tools_text(tools: Sequence[Tool], access: ToolAccess) -> str:
    """The lines of the start e-mail and the login message: per tool, its `ssh -L`
    line and URL. Empty without tools."""
    if not tools:
        return ""
    paragraphs = []
    for tool in tools:
        secret = " (the token is this session's: keep it to yourself)" if tool.token else ""
        paragraphs.append(
            f"{tool.title}: forward it over SSH, then open the URL{secret}:\n"
            f"  {forward_line(tool, access)}\n"
            f"  {tool_url(tool, access)}\n"
        )
    return inert_lines("\n".join(paragraphs))


def command_file(tool: Tool) -> str:
    return COMMAND_FILE.format(name=tool.name)


def command_text(command: Sequence[str]) -> str:
    """A command as its file holds it: each argument NUL-ended (what `xargs -0` reads)."""
    return "".join(f"{part}\0" for part in command)


def write_session_tools(
    files: SessionFiles,
    key: str,
    tools: Sequence[Tool],
    access: ToolAccess,
    owner: tuple[int, int],
) -> None:
    """Give session `key` its tools: each started tool's command, and (for the host ids
    `owner` of its login alone) the token, where a tool asks for one, and the login
    message's lines.

    Nothing is written without tools. Raises `SessionError` as `SessionFiles` does.
    """
    if not tools:
        return
    for tool in tools:
        if tool.command is not None:
            files.show_file(key, command_file(tool), command_text(tool.command))
    if any(tool.token for tool in tools):
        files.show_secret(key, TOKEN_FILE, access.token + "\n", *owner)
    files.show_secret(key, TEXT_FILE, tools_text(tools, access), *owner)


def daemon_secret(state_dir: Path) -> bytes:
    """The daemon's secret for tokens (`<state_dir>/tool-secret`, root's, 0600), made the
    first time. Raises `OSError` when it cannot be read or made."""
    path = state_dir / SECRET_FILE
    if not path.exists():
        # written whole under another name, then linked: a reader never sees half of it,
        # and of two daemons making it at once, one's stays
        temporary = state_dir / f".{SECRET_FILE}.{secrets.token_hex(6)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        descriptor = os.open(temporary, flags, 0o600)
        try:
            os.write(descriptor, secrets.token_bytes(SECRET_BYTES))
        finally:
            os.close(descriptor)
        try:
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)
        finally:
            temporary.unlink()
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        secret = os.read(descriptor, 4096)
    finally:
        os.close(descriptor)
    if len(secret) < SECRET_BYTES:
        raise OSError(f"{path} holds {len(secret)} bytes; remove it to make a new one")
    return secret
