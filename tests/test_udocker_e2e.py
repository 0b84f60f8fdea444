"""End to end on a udocker host: an ICS booking, the daemon as its own process, real udocker
and runc, a host account of the test's own, real sshd reached with paramiko, real SMTP.

The booking's login logs in over SSH at its start, writes its result, leaves processes that
ignore SIGTERM (one through sudo), and is stopped at the end: nothing of it runs by end +
grace + a few seconds, its output is kept, its own, and listed by `gpuresa outputs list`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest
from conftest import TEST_HOST, SMTPServer, run_login
from daemon_stage import DaemonProcess, at
from support.accounts import remove_account
from support.configs import write_daemon_config
from support.logins import try_login
from support.waiting import wait_for
from test_daemon_cli import ics_event

from gpuresa.backends.factory import open_backend
from gpuresa.backends.udocker import UdockerBackend
from gpuresa.backends.udocker.spares import spares
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config

GRACE = 2


@pytest.fixture(name="login")
def login_fixture() -> Iterator[str]:
    login = run_login("ue")
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", login], check=True)
    yield login
    remove_account(login)


@pytest.fixture(name="folder")
def folder_fixture() -> Iterator[Path]:
    """The site's folder, which every user may traverse (pytest's own is root's alone)."""
    root = Path(f"/tmp/gpuresa-udocker-e2e-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def let_in(port: int, login: str, key: Path) -> paramiko.SSHClient | None:
    """A login that gets into the session (not one told that it opens later), or None."""
    client = try_login(port, login, key)
    if client is None:
        return None
    try:
        _, out, _ = client.exec_command("true", timeout=10)
        if out.channel.recv_exit_status() == 0:
            return client
    except (paramiko.SSHException, OSError, EOFError):
        pass
    client.close()
    return None


def backend_of(config: Config) -> UdockerBackend:
    backend = open_backend(config)
    assert isinstance(backend, UdockerBackend)
    return backend


def test_a_booking_runs_as_its_login_and_ends_with_its_output_kept(
    folder: Path, login: str, smtp_server: SMTPServer
) -> None:
    config_file = write_daemon_config(
        folder,
        host=TEST_HOST,
        users=(login,),
        gpus=(),
        daemon=f'prepare_ahead = "60s"\nstop_grace = "{GRACE}s"\npoll_interval = "1s"',
        limits="pids = 256",
        host_lines='engine = "udocker"\ndriver_binaries = []',
        extra=f"""[notify]
enabled = true
smtp_host = "127.0.0.1"
smtp_port = {smtp_server.port}
sender = "gpuresa@example.org"
[users.emails]
{login} = "{login}@example.org"
""",
    )
    for name in ("keys", "calendar", "state"):
        (folder / name).mkdir(exist_ok=True)
        os.chmod(folder / name, 0o755)
    config = load_config(config_file)
    # provisioned ahead (image built and saved): no start waits on a build
    backend = backend_of(config)
    backend.provision("pytorch", None)

    # made as soon as the daemon runs: `udocker create` unpacks the image as the login, which
    # takes 15 s or more on a loaded 2-core machine, and the start must find it ready
    start = (datetime.now(UTC) + timedelta(seconds=35)).replace(microsecond=0)
    end = start + timedelta(seconds=20)
    (folder / "calendar" / "ud-1.ics").write_text(ics_event("ud-1", start, end, login, ""))
    daemon = DaemonProcess(config_file, folder / "daemon.log")
    try:
        prepared = wait_for(
            lambda: next((s for s in backend_of(config).list_sessions() if s.key == "ud-1"), None),
            at(start) - time.monotonic(),
            "the prepared session",
        )
        # before the start the login is told when the session opens; from the start it works
        client = wait_for(
            lambda: let_in(prepared.ssh_port, login, folder / "key"),
            at(start) - time.monotonic() + 10,
            "an SSH login at the start",
        )
        assert datetime.now(UTC) - start < timedelta(seconds=4)
        _, out, err = client.exec_command(
            "id -un; echo result > /output/result.txt; "
            "sudo -n nohup sh -c 'trap \"\" TERM; exec tail -f /dev/null' >/dev/null 2>&1 & "
            "setsid sh -c 'trap \"\" TERM; exec sleep 100000' >/dev/null 2>&1 & echo left",
            timeout=30,
        )
        text = out.read().decode() + err.read().decode()
        assert out.channel.recv_exit_status() == 0, text
        client.close()
        assert text.split()[:1] == [login] and "left" in text, text
        account = subprocess.run(["id", "-u", login], capture_output=True, text=True, check=True)
        result = prepared.output_dir / "result.txt"
        assert result.stat().st_uid == int(account.stdout)

        notice = wait_for(
            lambda: next((m for m in smtp_server.messages if "ready" in str(m["Subject"])), None),
            20,
            "the start notice",
        )
        body = notice.get_content()
        assert f"ssh -p {prepared.ssh_port} {login}@" in body
        assert f"sftp -P {prepared.ssh_port} {login}@" in body
        assert "FTP password" not in body and "FTPS" not in body

        # the end: nothing of the login's runs by end + grace + a few seconds
        def gone() -> bool:
            listed = subprocess.run(
                ["ps", "-ww", "-o", "stat=,args=", "-U", login], capture_output=True, text=True
            ).stdout.splitlines()
            # but the removal of the container's files
            running = [
                line for line in listed if line.split()[0][0] != "Z" and " rm -f " not in line
            ]
            sessions = backend_of(config).list_sessions()
            return not running and not any(item.key == "ud-1" for item in sessions)

        wait_for(gone, at(end) - time.monotonic() + GRACE + 8, "the session's end")
        assert result.read_text() == "result\n"
        listed = subprocess.run(
            [sys.executable, "-m", "gpuresa.cli", "--config", str(config_file),
             "outputs", "list", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)
        assert any(row["user"] == login and row["key"] == "ud-1" for row in rows), rows
        # on the defaults, the login's next session will start without unpacking its image
        image = backend.images.archive("pytorch", None)
        assert image is not None
        wait_for(lambda: spares(config, login, image[1]), 240, "the login's spare container")
    except BaseException:
        print((folder / "daemon.log").read_text(errors="replace")[-15000:])
        raise
    finally:
        daemon.terminate()
        for session in backend_of(config).list_sessions():
            backend_of(config).kill(session.key)
