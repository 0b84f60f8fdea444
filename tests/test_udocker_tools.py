"""The template's notebook on a udocker host: through `ssh -L` to a socket of the login's only.

udocker sessions share the host's network, so the notebook listens on no port
(the host's loopback is every host user's): its socket is in a host folder of
the login's, bound into the container at the same path, which the login's
own sshd forwards to. Another host user can neither connect to it nor read
its token.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from support.notebooks import http_get, ssh_forward
from support.waiting import wait_for
from test_udocker import Site, login_fixture, make_fixture, site_fixture, spec_of

from gpuresa.backends.udocker.sockets import host_tool_folder
from gpuresa.sessions.tools import daemon_secret, tool_token

# real host accounts, udocker and sshd: not for the fast lane
pytestmark = pytest.mark.services

__all__ = ["login_fixture", "make_fixture", "site_fixture"]  # the fixtures the tests take

ANSWER_WITHIN = 5.0


def test_the_notebook_answers_through_the_login_s_sshd_with_its_token_only(site: Site) -> None:
    backend = site.backend()
    # the template whose build falls back to Debian's Notebook on an image without pip
    spec = spec_of(site, backend, "tensorflow")
    asked = time.monotonic()
    backend.prepare(spec)
    prepared = time.monotonic()
    session = backend.start(spec)
    started = time.monotonic()
    folder = host_tool_folder(site.config, spec.key)
    socket = folder / "jupyter.sock"
    token = tool_token(daemon_secret(site.config.daemon.state_dir), spec.key, site.login)

    key_file = site.root / "private" / site.login
    with ssh_forward(session.ssh_port, site.login, key_file, str(socket)) as local:
        wait_for(
            lambda: (http_get(local, f"/api/status?token={token}") or (0, ""))[0] == 200,
            60,
            "the notebook to answer through the forwarded socket",
        )
        answered = time.monotonic()
        print(
            f"\nudocker: session prepared in {prepared - asked:.2f} s, let in in "
            f"{started - prepared:.2f} s; the notebook answered {answered - started:.2f} s "
            "after the start"
        )
        assert answered - started <= ANSWER_WITHIN
        assert http_get(local, "/api/status") == (403, "")
        status, location = http_get(local, "/tree") or (0, "")
        assert status == 302 and "/login" in location

    # the folder is the login's alone; another host user cannot connect nor read the token
    owner = subprocess.run(
        ["stat", "-c", "%a %U", str(folder)], capture_output=True, text=True, check=True
    )
    assert owner.stdout.split() == ["700", site.login]
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(3)\n"
    )
    other = subprocess.run(
        ["runuser", "-u", "nobody", "--", "python3", "-c", probe, str(socket)], check=False
    )
    assert other.returncode == 3
    files = backend.files.path(spec.key)
    for name in ("tools", "tool-token"):
        shown = subprocess.run(
            ["runuser", "-u", "nobody", "--", "cat", str(files / name)],
            capture_output=True,
            check=False,
        )
        assert shown.returncode != 0 and token.encode() not in shown.stdout
    code, text = site.run(session, "cat /etc/gpuresa/session/tools; bash -lic true 2>/dev/null")
    assert code == 0 and text.count(f"-L 8888:{socket} ") == 2, text
    backend.kill(spec.key)
    assert not folder.exists()
