"""Browser tools of templates (`[[tools]]`): the declaration, the token, the texts. Pure.

The sessions that start them and the notebook answering through `ssh -L` are
tested on the engines in test_tools_e2e.py and on udocker in
test_udocker_tools.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.configs import config_of

from gpuresa.config.capabilities import DOCKER, PODMAN, SLURM, UDOCKER
from gpuresa.config.reading import parse_config
from gpuresa.daemon.tool_lines import start_tool_lines
from gpuresa.mail.notices import start_message
from gpuresa.model import Session
from gpuresa.reservations.catalog import TemplateError, read_template
from gpuresa.reservations.template_tools import Tool, read_tools
from gpuresa.sessions.files import SessionFiles
from gpuresa.sessions.templates import resolve_template
from gpuresa.sessions.tools import (
    SESSION_SOCKETS,
    SOCKET_PATH_LIMIT,
    ToolAccess,
    command_text,
    daemon_secret,
    forward_line,
    reachable,
    tool_token,
    tool_url,
    tools_text,
    write_session_tools,
)

JUPYTER = {
    "name": "jupyter",
    "title": "JupyterLab",
    "command": ["/opt/gpuresa/notebook.sh"],
    "socket": True,
    "token": True,
    "local_port": 8888,
}
DIGITS = {"name": "digits", "title": "DIGITS", "port": 5000}
ACCESS = ToolAccess("alice", "gpu1.example.org", 20001, SESSION_SOCKETS, "f" * 48)


# --- the declaration ------------------------------------------------------------------------


def test_a_socket_tool_and_a_port_tool_are_read() -> None:
    tools, problems = read_tools({"tools": [JUPYTER, DIGITS]})
    assert problems == []
    assert tools == (
        Tool("jupyter", "JupyterLab", ("/opt/gpuresa/notebook.sh",), True, None, True, 8888),
        # a port's tool is reached on the same local port by default, without a token
        Tool("digits", "DIGITS", None, False, 5000, False, 5000),
    )
    assert read_tools({}) == ((), [])


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({**JUPYTER, "name": "Jupyter Lab"}, "tools[0].name: expected a name"),
        ({**JUPYTER, "name": "x" * 40}, "tools[0].name: expected a name"),
        ({**JUPYTER, "command": []}, "tools[0].command: expected a non-empty list"),
        ({**JUPYTER, "command": "jupyter lab"}, "tools[0].command: expected a non-empty list"),
        ({**JUPYTER, "command": ["a\0b"]}, "tools[0].command: a NUL character"),
        ({**JUPYTER, "port": 8888}, "tools[0]: give either socket = true or a port"),
        ({"title": "no name", "port": 80}, "tools[0].name: expected a name"),
        ({"name": "x", "title": "X"}, "tools[0]: give either socket = true or a port"),
        ({**DIGITS, "port": 70000}, "tools[0].port: expected a port number"),
        ({**DIGITS, "port": True}, "tools[0].port: expected a port number"),
        ({**DIGITS, "token": True}, "tools[0].token: only a tool on a socket"),
        ({**JUPYTER, "token": "yes"}, "tools[0].token: expected true or false"),
        ({**JUPYTER, "socket": 1}, "tools[0].socket: expected true or false"),
        ({**JUPYTER, "local_port": 0}, "tools[0].local_port: expected a port number"),
        ({**JUPYTER, "path": "lab?x=1"}, "tools[0].path: expected a URL path"),
        ({**JUPYTER, "title": ""}, "tools[0].title: expected a short text"),
        ({**JUPYTER, "url": "/lab"}, "tools[0].url: unknown key"),
        ("jupyter", "tools[0]: expected a table"),
    ],
)
def test_a_bad_tool_is_refused_with_its_key_path(entry: Any, problem: str) -> None:
    tools, problems = read_tools({"tools": [entry]})
    assert tools == ()
    assert any(found.startswith(problem) for found in problems), problems


def test_a_name_declared_twice_and_a_table_instead_of_a_list_are_refused() -> None:
    _, problems = read_tools({"tools": [JUPYTER, JUPYTER]})
    assert problems == ["tools[1].name: 'jupyter' is declared twice"]
    assert read_tools({"tools": JUPYTER})[1] == ["tools: expected [[tools]] tables"]


def test_a_template_with_a_bad_tool_cannot_be_chosen(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM scratch\n")
    (folder / "template.toml").write_text(
        '[variants."12.4"]\nbase_image = "x/y:1"\n[[tools]]\nname = "jupyter"\nsocket = true\n'
        "port = 8888\n"
    )
    with pytest.raises(TemplateError, match=r"tools\[0\]: give either socket = true or a port"):
        read_template(folder)


def test_the_shipped_templates_declare_their_tools() -> None:
    config = parse_config({}, "defaults")
    for name in ("pytorch", "tensorflow"):
        template, _ = resolve_template(config.templates, name, None)
        (jupyter,) = template.tools
        assert (jupyter.name, jupyter.socket, jupyter.token, jupyter.port) == (
            "jupyter",
            True,
            True,
            None,
        )
        assert jupyter.command == ("/opt/gpuresa/notebook.sh",)
    digits, _ = resolve_template(config.templates, "digits", None)
    (page,) = digits.tools
    # DIGITS's page as before: its own command on port 5000, no token
    assert (page.port, page.token, page.command) == (5000, False, None)
    assert digits.command == ("python3", "-m", "digits")


# --- the token ------------------------------------------------------------------------------


@given(
    secret=st.binary(min_size=32, max_size=32),
    key=st.text(min_size=1, max_size=40),
    other_key=st.text(min_size=1, max_size=40),
    login=st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True),
)
def test_a_token_is_the_session_s_own_and_the_same_each_time(
    secret: bytes, key: str, other_key: str, login: str
) -> None:
    token = tool_token(secret, key, login)
    assert token == tool_token(secret, key, login)
    assert len(token) == 48 and int(token, 16) >= 0
    if other_key != key:
        assert tool_token(secret, other_key, login) != token
    # another login on the booking, or another daemon's secret, gives another token
    assert tool_token(secret, key, login + "x") != token
    assert tool_token(bytes(reversed(secret)) + b"x", key, login) != token


def test_the_daemon_s_secret_is_made_once_for_root_alone(tmp_path: Path) -> None:
    secret = daemon_secret(tmp_path)
    assert len(secret) == 32
    assert daemon_secret(tmp_path) == secret
    mode = (tmp_path / "tool-secret").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert [path.name for path in tmp_path.iterdir()] == ["tool-secret"]
    (tmp_path / "tool-secret").write_bytes(b"short")
    with pytest.raises(OSError, match="holds 5 bytes"):
        daemon_secret(tmp_path)
    (tmp_path / "tool-secret").unlink()
    os.symlink(tmp_path / "elsewhere", tmp_path / "tool-secret")
    with pytest.raises(OSError):
        daemon_secret(tmp_path)


# --- the texts ------------------------------------------------------------------------------


def test_the_lines_give_one_ssh_forward_and_the_url_with_the_token() -> None:
    jupyter, digits = read_tools({"tools": [JUPYTER, DIGITS]})[0]
    assert forward_line(jupyter, ACCESS) == (
        "ssh -p 20001 -L 8888:/run/gpuresa-tools/jupyter.sock alice@gpu1.example.org"
    )
    assert tool_url(jupyter, ACCESS) == "http://localhost:8888/?token=" + "f" * 48
    assert forward_line(digits, ACCESS) == (
        "ssh -p 20001 -L 5000:localhost:5000 alice@gpu1.example.org"
    )
    assert tool_url(digits, ACCESS) == "http://localhost:5000/"
    text = tools_text((jupyter, digits), ACCESS)
    assert text.splitlines() == [
        "JupyterLab: forward it over SSH, then open the URL (the token is this session's: "
        "keep it to yourself):",
        "  ssh -p 20001 -L 8888:/run/gpuresa-tools/jupyter.sock alice@gpu1.example.org",
        "  http://localhost:8888/?token=" + "f" * 48,
        "",
        "DIGITS: forward it over SSH, then open the URL:",
        "  ssh -p 20001 -L 5000:localhost:5000 alice@gpu1.example.org",
        "  http://localhost:5000/",
    ]
    assert tools_text((), ACCESS) == ""


def test_a_socket_path_too_long_for_a_unix_socket_is_left_out() -> None:
    jupyter, digits = read_tools({"tools": [JUPYTER, DIGITS]})[0]
    fits = PurePosixPath("/" + "d" * (SOCKET_PATH_LIMIT - len("/jupyter.sock") - 1))
    assert len(str(fits / "jupyter.sock")) == SOCKET_PATH_LIMIT
    assert reachable((jupyter, digits), fits) == (jupyter, digits)
    assert reachable((jupyter, digits), fits / "x") == (digits,)
    # a backend that starts no tools offers none
    assert reachable((jupyter, digits), None) == ()


def test_where_each_backend_keeps_the_sockets() -> None:
    assert (DOCKER.tool_sockets, PODMAN.tool_sockets) == ("session", "session")
    assert (UDOCKER.tool_sockets, SLURM.tool_sockets) == ("host", "none")


def test_a_command_file_reads_back_through_xargs_as_the_same_arguments(tmp_path: Path) -> None:
    command = ["printf", "[%s]", "two words", "it's", "$HOME", "*", "-L"]
    (tmp_path / "command").write_text(command_text(command))
    result = subprocess.run(
        ["xargs", "-0", "-a", str(tmp_path / "command"), "sh", "-c", 'exec "$@"', "tool"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout == "[two words][it's][$HOME][*][-L]"


START = datetime(2024, 5, 3, 12, 0, tzinfo=UTC)
SESSION = Session(
    key="booking-42@20240503T120000Z",
    user="alice",
    host="gpu1",
    template="pytorch",
    cuda="12.4",
    gpu_count=1,
    gpu_indices=(0,),
    start=START,
    end=START + timedelta(hours=2),
    ssh_port=20001,
    ftp_port=21001,
    ftp_passive_first=30000,
    ftp_passive_last=30009,
    state="running",
    output_dir=Path("/var/lib/gpuresa/output/alice/x"),
    ftp_user="alice-ftp",
    ftp_password="s3cret-Pa55",
    email="alice@example.org",
)


def test_the_start_notice_gives_the_tools_after_the_login_line() -> None:
    jupyter = read_tools({"tools": [JUPYTER]})[0]
    lines = tools_text(jupyter, ACCESS)
    _, body = start_message(SESSION, "gpu1.example.org", "UTC", tools=lines)
    login = body.index("\nssh -p 20001 alice@gpu1.example.org\n")
    forward = body.index(
        "\n  ssh -p 20001 -L 8888:/run/gpuresa-tools/jupyter.sock alice@gpu1.example.org\n"
    )
    assert login < forward < body.index("  GPUs:")
    assert "http://localhost:8888/?token=" + "f" * 48 + "\n" in body
    # without tools, the notice is as it was
    _, plain = start_message(SESSION, "gpu1.example.org", "UTC")
    assert "ssh -p 20001 alice@gpu1.example.org\n\n  GPUs:" in plain
    assert "-L" not in plain


@pytest.mark.parametrize(
    ("engine", "folder"),
    [
        ("docker", "/run/gpuresa-tools"),
        ("podman", "/run/gpuresa-tools"),
        ("udocker", "{state}-udocker/tools/{digest}"),
        ("slurm", None),
    ],
)
def test_the_start_notice_names_the_socket_where_the_backend_keeps_it(
    tmp_path: Path, request: pytest.FixtureRequest, engine: str, folder: str | None
) -> None:
    # a short folder: pytest's own would make a udocker socket's path too long (left out)
    state = Path(tempfile.mkdtemp(prefix="gt-", dir="/tmp")) / "state"
    request.addfinalizer(lambda: shutil.rmtree(state.parent))
    state.mkdir()
    host = {"name": "gpu1", "engine": engine, "gpus": [], "gpu_mode": "none"}
    config = config_of(
        {"daemon": {"state_dir": str(state)}, "hosts": [host]}, source=str(tmp_path / "c.toml")
    )
    text = start_tool_lines(config, SESSION, "gpu1.example.org")
    if folder is None:
        # a backend that starts no tools announces none
        assert text == ""
        return
    digest = hashlib.sha256(SESSION.key.encode()).hexdigest()[:16]
    socket = folder.format(state=state, digest=digest) + "/jupyter.sock"
    token = tool_token(daemon_secret(state), SESSION.key, "alice")
    assert text.splitlines()[1:3] == [
        f"  ssh -p 20001 -L 8888:{socket} alice@gpu1.example.org",
        f"  http://localhost:8888/?token={token}",
    ]


def test_a_session_s_tool_files_are_the_login_s_alone(tmp_path: Path) -> None:
    files = SessionFiles(tmp_path / "sessions")
    jupyter, digits = read_tools({"tools": [JUPYTER, DIGITS]})[0]
    write_session_tools(files, "booking-1", (jupyter, digits), ACCESS, (12345, 23456))
    folder = files.path("booking-1")
    found = {path.name: path.stat() for path in folder.iterdir()}
    assert set(found) == {"tool-jupyter.command", "tool-token", "tools"}
    assert (folder / "tool-jupyter.command").read_bytes() == b"/opt/gpuresa/notebook.sh\0"
    assert stat.S_IMODE(found["tool-jupyter.command"].st_mode) == 0o644
    for name in ("tool-token", "tools"):
        assert stat.S_IMODE(found[name].st_mode) == 0o400
        assert (found[name].st_uid, found[name].st_gid) == (12345, 23456)
    assert (folder / "tool-token").read_text() == ACCESS.token + "\n"
    assert (folder / "tools").read_text() == tools_text((jupyter, digits), ACCESS)
    # a tool without a token of its own gets none; a template without tools, no files
    write_session_tools(files, "booking-2", (digits,), ACCESS, (12345, 23456))
    assert sorted(path.name for path in files.path("booking-2").iterdir()) == ["tools"]
    write_session_tools(files, "booking-3", (), ACCESS, (12345, 23456))
    assert not files.path("booking-3").exists()
