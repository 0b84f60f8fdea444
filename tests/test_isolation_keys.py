"""No one but gpuresa decides which keys log in to a session.

The attack, on Docker with `userns-remap`: a host process running as the uid
that is root in every Docker session (an engine bug, an admin's mistake)
writes its own key into another session's key file, which used to live in
that session's container layer (the uid's own files). The keys are now a
root-only host file, mounted read-only, and sshd reads no key file of the
container. Each route is tried on both engines, from the host as the
session's root uid and as a host account, and from inside as sudo root; the
control shows that the container layer itself is still the uid's to write,
so the test fails if sshd reads keys from it again.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import paramiko
import pytest
from conftest import run_login
from test_isolation_output import as_user
from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    built_fixture,
    run,
    site_fixture,
    ssh_login,
)

from gpuresa.model import Session


def as_ids(uid: int, gid: int, script: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    """Run a shell script as host uid:gid, no groups (what a stray process of that uid has)."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
         "/bin/sh", "-c", script, "sh", *arguments],
        capture_output=True,
        text=True,
        timeout=20,
    )  # fmt: skip


@pytest.fixture
def account() -> Iterator[int]:
    """A throw-away host account with a shell (removed afterwards): its uid."""
    login = run_login("gkey")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", login], check=True)
    try:
        yield int(subprocess.run(["id", "-u", login], capture_output=True, text=True).stdout)
    finally:
        subprocess.run(["userdel", login], check=False)


@pytest.fixture
def intruder(tmp_path: Path) -> Iterator[tuple[str, paramiko.PKey]]:
    """A key pair nobody gave to any session: (public line, private key)."""
    path = tmp_path / "intruder"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    yield (
        path.with_suffix(".pub").read_text().strip(),
        paramiko.Ed25519Key.from_private_key_file(str(path)),
    )


def refused(session: Session, key: paramiko.PKey) -> bool:
    """Whether sshd refuses `key` for the session's login."""
    try:
        with ssh_login(session, session.user, key):
            return False
    except paramiko.AuthenticationException:
        return True


def _layer(site: Site, session: Session) -> Path:
    """The session's main container's writable layer on the host."""
    details = site.client.api.inspect_container(session.containers[0])
    return Path(details["GraphDriver"]["Data"]["UpperDir"])


def _pid(site: Site, session: Session) -> int:
    return int(site.client.api.inspect_container(session.containers[0])["State"]["Pid"])


def test_no_one_but_gpuresa_writes_a_sessions_authorized_keys(
    site: Site, account: int, intruder: tuple[str, paramiko.PKey]
) -> None:
    public, private = intruder
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    try:
        assert session.id_range is not None
        root_uid, root_gid = session.id_range.uid, session.id_range.gid
        keys = runtime.files.path(session.key) / "authorized_keys"
        assert "alice@test" in keys.read_text()
        assert (keys.stat().st_uid, keys.parent.parent.stat().st_mode & 0o777) == (0, 0o700)

        # from the host, as the session's root uid: the file by its path
        append = 'echo "$1" >> "$2"'
        result = as_ids(root_uid, root_gid, append, public, str(keys))
        assert result.returncode != 0 and "Permission denied" in result.stderr
        # through the container's root folder (/proc/<pid>/root)
        through = f"/proc/{_pid(site, session)}/root/etc/gpuresa/session/authorized_keys"
        result = as_ids(root_uid, root_gid, append, public, through)
        assert result.returncode != 0, result
        # and as a host account with a shell
        assert as_user(account, "/bin/sh", "-c", append, "sh", public, str(keys)).returncode != 0

        # the container layer is still the uid's (control: where the keys used to be),
        # and sshd reads no key file from it
        layer = _layer(site, session)
        target = "$2/etc/ssh/authorized_keys"
        plant = f'mkdir -p "{target}" && echo "$1" >"{target}/alice"'
        result = as_ids(root_uid, root_gid, plant, public, str(layer))
        if site.engine == "docker":
            # Docker's data root lets the remapped uid in: the route was real
            assert result.returncode == 0, result.stderr
        root_plant = subprocess.run(["/bin/sh", "-c", plant, "sh", public, str(layer)], check=False)
        assert root_plant.returncode == 0

        with ssh_login(session, "alice", site.key("alice")) as client:
            # from inside, as sudo root: the file is nobody's there (root's on the host)...
            code, output = run(
                client, f"echo '{public}' | sudo -n tee -a /etc/gpuresa/session/authorized_keys"
            )
            assert code != 0 and "Permission denied" in output, output
            # ...and the mount is read-only, which a user namespace cannot change
            code, output = run(client, "grep ' /etc/gpuresa/session ' /proc/self/mountinfo")
            assert code == 0 and "ro" in output.split()[5].split(","), output
            code, output = run(client, "sudo -n mount -o remount,rw /etc/gpuresa/session")
            assert code != 0, output
            # the container's own key files count for nothing, whoever writes them
            code, output = run(
                client,
                f"mkdir -p ~/.ssh && echo '{public}' > ~/.ssh/authorized_keys && "
                f"echo '{public}' | sudo -n tee /etc/ssh/authorized_keys/alice",
            )
            assert code == 0, output
        assert refused(session, private)
        assert "intruder" not in keys.read_text() and public not in keys.read_text()
        # the user still logs in with their own key
        with ssh_login(session, "alice", site.key("alice")) as client:
            assert run(client, "id -un")[1].strip() == "alice"
    finally:
        runtime.stop(session.key, timedelta(seconds=1))
