"""The browser tools a session template declares (`[[tools]]` in its template.toml).

A tool is a web server of the session (JupyterLab, DIGITS's page) that its user
reaches through the session's SSH server (`ssh -L`), never through a port of the
host's:

    [[tools]]
    name = "jupyter"                        # its socket's name; unique in the template
    title = "JupyterLab"                    # what the e-mail and login message call it
    command = ["/opt/gpuresa/notebook.sh"]  # optional: started as the user, in the
                                            # background, when the session's container starts
    socket = true                           # listens on the unix socket gpuresa names
    token = true                            # and asks for the session's token
    local_port = 8888                       # the port on the user's computer (ssh -L)

or, for a server that listens on a TCP port inside the session (DIGITS):

    [[tools]]
    name = "digits"
    title = "DIGITS"
    port = 5000                             # served by the template's `command`

Pure: `read_tools` turns the parsed TOML into `Tool`s, or problems with their
key paths (`tools[0].port: …`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# short enough for a socket path, and a file name whatever the tool
TOOL_NAME = r"[a-z][a-z0-9-]{0,30}"
KNOWN_KEYS = frozenset(
    {"name", "title", "command", "socket", "port", "token", "local_port", "path"}
)
# the local port when the template gives none: Jupyter's usual one
DEFAULT_LOCAL_PORT = 8888


@dataclass(frozen=True)
class Tool:
    """One browser tool of a template.

    `socket`: it listens on the unix socket gpuresa gives it (`GPURESA_TOOL_SOCKET`);
    else on TCP `port` inside the session. `token`: it asks for the session's token
    (given in `GPURESA_TOOL_TOKEN_FILE`), which the URL carries. `command`: what
    starts it (None: the template's own command serves it).
    """

    name: str
    title: str
    command: tuple[str, ...] | None
    socket: bool
    port: int | None
    token: bool
    local_port: int
    path: str = "/"


def read_tools(data: Mapping[str, Any]) -> tuple[tuple[Tool, ...], list[str]]:
    """The `[[tools]]` of a parsed template.toml, and every problem found (key path first).

    A tool with a problem is left out; the caller refuses the template when
    any problem is returned.
    """
    entries = data.get("tools", [])
    if not isinstance(entries, list):
        return (), ["tools: expected [[tools]] tables"]
    tools: list[Tool] = []
    problems: list[str] = []
    for index, entry in enumerate(entries):
        where = f"tools[{index}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected a table")
            continue
        found = _tool(where, entry)
        if isinstance(found, Tool):
            if any(tool.name == found.name for tool in tools):
                problems.append(f"{where}.name: {found.name!r} is declared twice")
            else:
                tools.append(found)
        else:
            problems += found
    return tuple(tools), problems


def _tool(where: str, entry: Mapping[str, Any]) -> Tool | list[str]:
    """One `[[tools]]` table as a `Tool`, or its problems."""
    problems = [f"{where}.{key}: unknown key" for key in sorted(set(entry) - KNOWN_KEYS)]
    name = entry.get("name")
    if not isinstance(name, str) or not re.fullmatch(TOOL_NAME, name):
        problems.append(f"{where}.name: expected a name of lower-case letters, digits and '-'")
    title = entry.get("title", name)
    if not isinstance(title, str) or not title.strip() or len(title) > 60:
        problems.append(f"{where}.title: expected a short text")
    command = entry.get("command")
    if command is not None and not (
        isinstance(command, list) and command and all(isinstance(part, str) for part in command)
    ):
        problems.append(f"{where}.command: expected a non-empty list of strings")
    if command is not None and any("\0" in part for part in command):
        problems.append(f"{where}.command: a NUL character cannot be in an argument")
    socket = entry.get("socket", False)
    port = entry.get("port")
    if not isinstance(socket, bool):
        problems.append(f"{where}.socket: expected true or false")
    elif socket == (port is not None):
        problems.append(f"{where}: give either socket = true or a port, not both or neither")
    if port is not None and not _port(port):
        problems.append(f"{where}.port: expected a port number (1-65535)")
    token = entry.get("token", False)
    if not isinstance(token, bool):
        problems.append(f"{where}.token: expected true or false")
    elif token and port is not None:
        # only a socket's tool is started by gpuresa with the token
        problems.append(f"{where}.token: only a tool on a socket gets gpuresa's token")
    local_port = entry.get("local_port", port if port is not None else DEFAULT_LOCAL_PORT)
    if not _port(local_port):
        problems.append(f"{where}.local_port: expected a port number (1-65535)")
    path = entry.get("path", "/")
    if not isinstance(path, str) or not re.fullmatch(r"/[A-Za-z0-9/._~-]*", path):
        problems.append(f"{where}.path: expected a URL path such as '/' or '/lab'")
    if problems or not isinstance(name, str):
        return problems
    return Tool(
        name=name,
        title=title,
        command=tuple(command) if command is not None else None,
        socket=socket,
        port=port,
        token=token,
        local_port=local_port,
        path=path,
    )


def _port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
