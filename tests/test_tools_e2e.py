"""The template's notebook on the engines (Docker, Podman): through `ssh -L` only, with its token.

A tensorflow session on the local base image (Debian's classic Notebook where no
pip is at hand: what that template's build falls back to) is started from
nothing; its user forwards the notebook's socket with the line of the login
message, and the notebook answers with the session's token within 5 s of the
start, and refuses without it. Nothing listens on a TCP port for it, and its
socket, token and lines are the login's alone.
"""

from __future__ import annotations

import time

from support.notebooks import http_get, ssh_forward
from support.waiting import wait_for
from test_runtime import Site, run, ssh_login
from test_runtime import built_fixture as built_fixture  # the module's image builds
from test_runtime import site_fixture as site_fixture

from gpuresa.daemon.tool_lines import start_tool_lines
from gpuresa.sessions.tool_access import public_host
from gpuresa.sessions.tools import SESSION_SOCKETS, daemon_secret, tool_token

# how soon after a session's start its notebook must answer
ANSWER_WITHIN = 5.0
# the template whose build falls back to Debian's Notebook on an image without pip
NOTEBOOK_TEMPLATE = "tensorflow"


def test_the_notebook_answers_through_ssh_with_its_token_only(site: Site) -> None:
    runtime = site.runtime()
    runtime.ensure_image(NOTEBOOK_TEMPLATE, None)
    spec = site.spec(runtime, template=NOTEBOOK_TEMPLATE)
    asked = time.monotonic()
    session = runtime.start(spec)
    started = time.monotonic()
    token = tool_token(daemon_secret(site.config.daemon.state_dir), spec.key, "alice")
    socket = SESSION_SOCKETS / "jupyter.sock"
    key_file = site.root / "private" / "alice"

    with ssh_forward(session.ssh_port, "alice", key_file, str(socket)) as local:
        answer = wait_for(
            lambda: (http_get(local, f"/api/status?token={token}") or (0, ""))[0] == 200,
            60,
            "the notebook to answer through the forwarded socket",
        )
        answered = time.monotonic()
        print(
            f"\n{site.engine}: session started in {started - asked:.2f} s; the notebook "
            f"answered {answered - started:.2f} s after the start"
        )
        assert answer
        assert answered - started <= ANSWER_WITHIN
        # without the token, or with another, nothing is served
        assert http_get(local, "/api/status") == (403, "")
        assert http_get(local, "/api/status?token=" + "0" * 48) == (403, "")
        status, location = http_get(local, "/tree") or (0, "")
        assert status == 302 and "/login" in location
        # the URL of the login message logs in (and goes on to the notebook's page)
        status, location = http_get(local, f"/?token={token}") or (0, "")
        assert status == 302 and "/login" not in location

    lines = (
        f"ssh -p {session.ssh_port} -L 8888:{socket} alice@{public_host(site.config)}",
        f"http://localhost:8888/?token={token}",
    )
    with ssh_login(session, "alice", site.key("alice")) as client:
        code, text = run(client, "cat /etc/gpuresa/session/tools")
        assert code == 0 and all(line in text for line in lines), text
        # the start e-mail gives the same lines
        assert text == start_tool_lines(site.config, session, public_host(site.config))
        # the login message shows them (interactive login shells)
        code, text = run(client, "bash -lic true 2>/dev/null")
        assert all(line in text for line in lines), text
        # the socket's folder, the token and the lines are the login's alone
        code, text = run(
            client,
            "stat -c '%a %U' /run/gpuresa-tools /etc/gpuresa/session/tool-token "
            "/etc/gpuresa/session/tools",
        )
        assert text.split("\n")[:3] == ["700 alice", "400 alice", "400 alice"], text
        # no TCP port is opened for it: sshd's alone listens (and, on Docker's networks, the
        # engine's DNS resolver at 127.0.0.11)
        code, text = run(client, "ss -Hltn | awk '{print $4}'")
        listening = {line.rsplit(":", 1)[-1] for line in text.split() if "127.0.0.11:" not in line}
        assert code == 0 and listening == {"22"}, text
        # the token is passed in the environment, never on a command line
        code, text = run(client, "ps -eo args")
        assert token not in text
