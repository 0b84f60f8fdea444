"""SSH host certificates on both engines, checked by OpenSSH itself.

Users keep the `@cert-authority` lines of the start e-mail (one per port) and
nothing else; the real `ssh` and `sftp` clients, with StrictHostKeyChecking=yes,
must accept every session and the output service, and refuse a session's key
after its time (shortened by the daemon's own re-signing, then served on its
freed port by a stand-in sshd that a thief would run) and any key without a
certificate (on other ports: test_host_certificate_ports.py). A session's
root must find neither the CA's private key nor another session's host key,
and a host user cannot bind the default ports at all.
"""

from __future__ import annotations

import dataclasses
import errno
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import BASE_IMAGE, DockerHarness, run_login
from support.configs import free_ports
from test_runtime import Site, built_fixture, make_site, port_free, ssh_login

from gpuresa.backends.engines.output_service import OutputService
from gpuresa.config.reading import parse_config
from gpuresa.mail.notices import start_message
from gpuresa.model import Session
from gpuresa.outputs.host_ca import CERTIFICATE, HOST_KEY, PUBLIC, HostCA
from gpuresa.outputs.messages import start_details
from gpuresa.sessions.files import HOST_KEYS_FOLDER

__all__ = ["built_fixture"]  # a fixture of test_runtime.py, used here too

# the default ranges' ends, from the config's own defaults
DEFAULTS = parse_config({"hosts": [{"name": "localhost"}]})


def privileged_block(size: int) -> int:
    """The first of `size` consecutive free ports inside the default SSH and FTP ranges."""
    host = DEFAULTS.hosts[0]
    low, high = host.ssh_ports.first, host.ftp_ports.last
    for _ in range(200):
        first = random.randrange(low, high - size)
        if all(port_free(port) for port in range(first, first + size)):
            return first
    pytest.fail(f"no {size} consecutive free ports in {low}-{high}")


@pytest.fixture(name="site")
def cert_site(
    tmp_path: Path, engine_harness: DockerHarness, built: Callable[[DockerHarness], None]
) -> Site:
    """A site on each engine whose ports are privileged ones of the default ranges."""
    built(engine_harness)
    first = privileged_block(5)
    # passive ports are never privileged (see config.sections.HostConfig): a free block
    # of the same kind as the default range
    passive = free_ports(6)
    site = make_site(
        tmp_path,
        engine_harness.client,
        engine=engine_harness.engine,
        aliases=["127.0.0.1"],
        ssh_ports=f"{first}-{first + 1}",
        ftp_ports=f"{first + 2}-{first + 3}",
        ftp_passive_ports=f"{passive}-{passive + 5}",
    )
    storage = dataclasses.replace(site.config.storage, sftp_port=first + 4)
    site.config = dataclasses.replace(site.config, storage=storage)
    return site


def served_key(port: int) -> str:
    """The plain Ed25519 host key a server on `port` presents (its base64 blob)."""
    probe = subprocess.run(
        ["ssh-keyscan", "-t", "ed25519", "-p", str(port), "-T", "10", "127.0.0.1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    blobs = [line.split()[2] for line in probe.stdout.splitlines() if "ssh-ed25519" in line]
    assert len(blobs) == 1, probe
    return blobs[0]


def openssh(site: Site, known_hosts: Path, port: int, login: str = "alice") -> Any:
    """`ssh -p PORT login@127.0.0.1 true` trusting only `known_hosts`, strictly."""
    command = [
        "ssh", "-p", str(port), "-i", str(site.root / "private" / login),
        "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
        "-o", "HostKeyAlgorithms=ssh-ed25519-cert-v01@openssh.com,ssh-ed25519",
        "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
        f"{login}@127.0.0.1", "true",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def openssh_sftp(site: Site, known_hosts: Path, port: int, login: str = "alice") -> Any:
    command = [
        "sftp", "-b", "-", "-P", str(port), "-i", str(site.root / "private" / login),
        "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
        "-o", "HostKeyAlgorithms=ssh-ed25519-cert-v01@openssh.com,ssh-ed25519",
        "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", f"{login}@127.0.0.1",
    ]  # fmt: skip
    return subprocess.run(command, input="ls\n", capture_output=True, text=True, timeout=60)


def service_port(site: Site) -> int:
    return site.config.storage.sftp_port


def refused(result: Any) -> bool:
    return result.returncode != 0 and "Host key verification failed" in result.stderr


def key_folder(site: Site, session: Session) -> Path:
    return site.runtime().files.path(session.key) / HOST_KEYS_FOLDER


def stand_in_sshd(harness: DockerHarness, folder: Path, port: int, certified: bool) -> Any:
    """A thief's sshd on `port`, as real root, presenting the key (and certificate) in `folder`.

    On Docker for either engine's sessions: what is checked is the client's verdict.
    """
    options = f"-h /keys/{HOST_KEY}" + (
        f" -o HostCertificate=/keys/{CERTIFICATE}" if certified else ""
    )
    script = f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -f /dev/null {options}"
    container = harness.run(
        BASE_IMAGE,
        ["/bin/sh", "-c", script],
        userns_mode="host",
        ports={"22/tcp": ("127.0.0.1", port)},
        volumes={str(folder): {"bind": "/keys", "mode": "ro"}},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = subprocess.run(
            ["ssh-keyscan", "-p", str(port), "-T", "2", "127.0.0.1"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if "ssh-ed25519" in probe.stdout:
            return container
        time.sleep(0.5)
    container.reload()
    pytest.fail(f"the stand-in sshd did not answer: {container.logs().decode()}")


def test_the_lines_trust_every_session_and_the_service_and_nothing_after_its_time(
    site: Site, docker_harness: DockerHarness, tmp_path: Path
) -> None:
    runtime = site.runtime()
    alice = runtime.start(site.spec(runtime, "alice"))
    bob = runtime.start(site.spec(runtime, "bob"))
    service = OutputService(site.config, runtime)
    service.ensure_running()

    # the lines users are given, one per port, and nothing else
    _, body = start_message(
        alice, "127.0.0.1", "UTC", details=start_details(site.config, alice, "127.0.0.1")
    )
    lines = [line.strip() for line in body.splitlines() if "@cert-authority" in line]
    assert len(lines) == len(site.config.host().ssh_ports) + 1
    assert f"[{site.config.daemon.host}]:{alice.ssh_port}," in lines[0] + lines[1]
    rest = body
    for line in lines:
        rest = rest.replace(line, "")
    assert " ssh-ed25519 " not in rest  # no shared keys any more
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("".join(line + "\n" for line in lines))

    for session in (alice, bob):
        result = openssh(site, known_hosts, session.ssh_port, session.user)
        assert result.returncode == 0, result.stderr
    listing = openssh_sftp(site, known_hosts, site.config.storage.sftp_port)
    assert listing.returncode == 0, listing.stderr
    # the login's folder is served; a running output is not in it before its end
    assert alice.output_dir.name not in listing.stdout
    # three different host keys, each its own: nobody holds another's
    served = [served_key(port) for port in (alice.ssh_port, bob.ssh_port, service_port(site))]
    assert len(set(served)) == 3
    assert served[0] == (key_folder(site, alice) / PUBLIC).read_text().split()[1]

    # the daemon shortens alice's time (an end in the past): new connections see it at once
    now = datetime.now(UTC)
    runtime.extend(alice.key, now - timedelta(minutes=10))
    assert refused(openssh(site, known_hosts, alice.ssh_port))
    # extended again: the renewed certificate counts for the next connection, no restart
    runtime.extend(alice.key, now + timedelta(hours=1))
    result = openssh(site, known_hosts, alice.ssh_port)
    assert result.returncode == 0, result.stderr

    # a thief copies alice's key and certificate; after her time they are worth nothing
    runtime.extend(alice.key, now - timedelta(minutes=10))
    stolen = tmp_path / "stolen"
    shutil.copytree(key_folder(site, alice), stolen)
    runtime.stop(alice.key, grace=timedelta(seconds=1))
    # her own port, freed: only root could take it, as the thief must be
    port = alice.ssh_port
    deadline = time.monotonic() + 30
    while not port_free(port) and time.monotonic() < deadline:
        time.sleep(0.5)
    thief = stand_in_sshd(docker_harness, stolen, port, certified=True)
    assert refused(openssh(site, known_hosts, port))
    thief.remove(force=True)
    # and a key without any certificate is refused by the same line
    bare = tmp_path / "bare"
    bare.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(bare / HOST_KEY)],
                   check=True)  # fmt: skip
    thief = stand_in_sshd(docker_harness, bare, port, certified=False)
    assert refused(openssh(site, known_hosts, port))
    thief.remove(force=True)
    # the stand-in with a valid certificate is accepted: the refusals above are the time's
    HostCA(site.config).renew_session_certificate(stolen, alice.key, now, now + timedelta(hours=1))
    thief = stand_in_sshd(docker_harness, stolen, port, certified=True)
    result = openssh(site, known_hosts, port)
    assert result.returncode != 0 and not refused(result)  # trusted host, unknown login
    thief.remove(force=True)


def test_a_session_holds_neither_the_ca_key_nor_another_sessions_host_key(site: Site) -> None:
    runtime = site.runtime()
    alice = runtime.start(site.spec(runtime, "alice"))
    bob = runtime.start(site.spec(runtime, "bob"))
    ca = HostCA(site.config)
    ca_publics = {ca.public_line(port).split()[1] for port in ca.ports()}
    # her own port's CA, the one she would most want
    ca_private = (
        site.config.daemon.state_dir / "host-ca" / f"port-{alice.ssh_port}_ed25519"
    ).read_text()
    # the key's body after its header and public half: random bytes of this key alone
    secret_lines = [line for line in ca_private.splitlines()[3:] if len(line) >= 60]
    assert secret_lines
    bob_public = (key_folder(site, bob) / PUBLIC).read_text().split()[1]
    alice_public = (key_folder(site, alice) / PUBLIC).read_text().split()[1]
    # as root in alice's session: every private key anywhere, as public keys
    search = (
        "grep -rlIs -e 'PRIVATE KEY-----' / --exclude-dir=proc --exclude-dir=sys "
        '--exclude-dir=dev | while read -r file; do ssh-keygen -y -f "$file" 2>/dev/null; done'
    )
    with ssh_login(alice, "alice", site.key("alice")) as client:
        found = slow_run(client, f"sudo -n sh -c {_quoted(search)}")
        raw = slow_run(
            client,
            f"sudo -n grep -rlsF {' '.join('-e ' + _quoted(line) for line in secret_lines)} / "
            "--exclude-dir=proc "
            "--exclude-dir=sys --exclude-dir=dev; echo searched",
        )
    assert alice_public in found  # the search finds keys: its own host key
    assert not any(public in found for public in ca_publics)
    assert bob_public not in found
    assert raw.strip() == "searched"


def slow_run(client: Any, command: str) -> str:
    """`command`'s output in the session (a search of the whole tree takes a while)."""
    _, stdout, _ = client.exec_command(command, timeout=300)
    return str(stdout.read().decode())


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_a_host_user_cannot_bind_the_default_ports(host_user: str) -> None:
    host = DEFAULTS.hosts[0]
    ports = [DEFAULTS.storage.sftp_port]
    for name in ("ssh_ports", "ftp_ports"):
        ports += [getattr(host, name).first, getattr(host, name).last]
    script = (
        "import socket, sys\n"
        "for port in map(int, sys.argv[1:]):\n"
        "    s = socket.socket()\n"
        "    try:\n"
        "        s.bind(('0.0.0.0', port)); print(port, 'bound')\n"
        "    except OSError as error:\n"
        "        print(port, error.errno)\n"
    )
    result = subprocess.run(
        ["runuser", "-u", host_user, "--", "python3", "-c", script, *map(str, ports)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    answers = dict(line.split() for line in result.stdout.splitlines())
    assert answers == {str(port): str(errno.EACCES) for port in ports}
    # the same user binds an unprivileged port: the refusal is the port's, not the user's
    free = subprocess.run(
        ["runuser", "-u", host_user, "--", "python3", "-c", script, "0"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert free.stdout.split() == ["0", "bound"]


@pytest.fixture
def host_user() -> Any:
    """A throw-away unprivileged account on this host, removed afterwards."""
    login = run_login("gport")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", login], check=True)
    try:
        yield login
    finally:
        subprocess.run(["userdel", login], check=False)
