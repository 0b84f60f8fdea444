"""A session's host certificate counts on its own port only, checked by OpenSSH itself.

A session's root holds its host key and certificate. Served by a host user's
own sshd on an unprivileged port, or by root on another session's port, they
must be refused by a client that trusts what gpuresa tells users to trust,
while the session itself stays accepted on its port. Sessions certified by
the single CA of earlier versions keep it until their end, and its line as
printed now no longer reaches beyond the session ports.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import DockerHarness
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from support.configs import free_ports
from test_host_certificates import (
    cert_site,
    host_user,
    key_folder,
    openssh,
    refused,
    stand_in_sshd,
)
from test_runtime import Site, built_fixture

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.mail.notices import start_message
from gpuresa.model import Session
from gpuresa.outputs.host_ca import CERTIFICATE, HOST_KEY, PUBLIC, HostCA
from gpuresa.outputs.messages import start_details

__all__ = ["built_fixture", "cert_site", "host_user"]  # fixtures used here too


def trusted_lines(site: Site, session: Session, folder: Path) -> Path:
    """A known_hosts file of what the session's start notice tells its user to add, alone."""
    _, body = start_message(
        session, "127.0.0.1", "UTC", details=start_details(site.config, session, "127.0.0.1")
    )
    lines = [line.strip() for line in body.splitlines() if "@cert-authority" in line]
    path = folder / "known_hosts"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def taken_for_the_host(result: Any) -> bool:
    """The client trusted the server's host key and went on to log in (and was refused there)."""
    return result.returncode != 0 and "Permission denied" in result.stderr


@contextlib.contextmanager
def users_sshd(login: str, stolen: Path, port: int) -> Iterator[None]:
    """`login`'s own sshd on `port`, serving the host key and certificate copied from `stolen`."""
    folder = Path(tempfile.mkdtemp(prefix="gpuresa-copied-"))
    process: subprocess.Popen[str] | None = None
    try:
        for name in (HOST_KEY, CERTIFICATE):
            shutil.copyfile(stolen / name, folder / name)
            shutil.chown(folder / name, login, login)
        shutil.chown(folder, login, login)
        (folder / HOST_KEY).chmod(0o600)
        # setpriv execs sshd itself: the process to stop is the one started here
        command = [
            "setpriv", f"--reuid={login}", f"--regid={login}", "--init-groups",
            "/usr/sbin/sshd", "-D", "-e", "-f", "/dev/null", "-p", str(port),
            "-o", "ListenAddress=127.0.0.1", "-o", "PidFile=none",
            "-h", str(folder / HOST_KEY), "-o", f"HostCertificate={folder / CERTIFICATE}",
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 30
        while "ssh-ed25519" not in subprocess.run(
            ["ssh-keyscan", "-p", str(port), "-T", "2", "127.0.0.1"],
            capture_output=True, text=True, timeout=30,
        ).stdout:  # fmt: skip
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"{login}'s sshd did not answer: {process.communicate()[0]}")
            time.sleep(0.3)
        yield
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_session_certificate_is_refused_on_any_port_but_its_own(
    site: Site, docker_harness: DockerHarness, host_user: str, tmp_path: Path
) -> None:
    runtime = site.runtime()
    alice = runtime.start(site.spec(runtime, "alice"))
    known_hosts = trusted_lines(site, alice, tmp_path)
    assert ":*" not in known_hosts.read_text()
    result = openssh(site, known_hosts, alice.ssh_port)
    assert result.returncode == 0, result.stderr

    # alice is root in her session: its host key and certificate are hers to copy
    stolen = tmp_path / "stolen"
    shutil.copytree(key_folder(site, alice), stolen)
    port = free_ports(1)
    with users_sshd(host_user, stolen, port):
        assert refused(openssh(site, known_hosts, port))
        # the one "[name]:*" line of earlier versions took the same server for the host
        everywhere = tmp_path / "everywhere"
        signer = HostCA(site.config).public_line(alice.ssh_port)
        everywhere.write_text(f"@cert-authority [127.0.0.1]:* {signer}\n")
        assert taken_for_the_host(openssh(site, everywhere, port))

    # served as root on the other session port of the host (free now): refused as well
    other = next(port for port in site.config.host().ssh_ports if port != alice.ssh_port)
    thief = stand_in_sshd(docker_harness, stolen, other, certified=True)
    try:
        assert refused(openssh(site, known_hosts, other))
    finally:
        thief.remove(force=True)

    # and the session itself, on its port, is still what its user reaches
    result = openssh(site, known_hosts, alice.ssh_port)
    assert result.returncode == 0, result.stderr


def signer_of(path: Path) -> bytes:
    loaded = serialization.load_ssh_public_identity(path.read_bytes())
    assert isinstance(loaded, serialization.SSHCertificate)
    return loaded.signature_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )


def private_text(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )


def public_text(key: ed25519.Ed25519PrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def test_a_session_of_the_old_single_ca_keeps_it_until_its_end(
    site: Site, host_user: str, tmp_path: Path
) -> None:
    runtime = site.runtime()
    alice = runtime.start(site.spec(runtime, "alice"))
    ca = HostCA(site.config)
    assert ca.legacy_until(datetime.now(UTC)) is None
    assert "upgrade" not in ca.known_hosts_text()
    # as an earlier version left it: its one CA, and alice's certificate signed by it
    legacy = ed25519.Ed25519PrivateKey.generate()
    legacy_path = site.config.daemon.state_dir / "host-ca" / "ca_ed25519"
    legacy_path.write_bytes(private_text(legacy))
    legacy_path.chmod(0o600)
    folder = key_folder(site, alice)
    public = serialization.load_ssh_public_key((folder / PUBLIC).read_bytes())
    assert isinstance(public, ed25519.Ed25519PublicKey)
    after, before = ca.session_window(alice.start, alice.end)
    (folder / CERTIFICATE).write_bytes(ca.sign(public, "old", after, before, legacy))
    old_line = tmp_path / "old_known_hosts"
    old_line.write_text(f"@cert-authority [{site.config.daemon.host}]:*,[127.0.0.1]:* "
                        f"{public_text(legacy)}\n")  # fmt: skip
    result = openssh(site, old_line, alice.ssh_port)
    assert result.returncode == 0, result.stderr

    # what users are told now adds the old CA, on the session ports only, until alice's end
    text = ca.known_hosts_text()
    assert ca.legacy_until(datetime.now(UTC)) == before
    assert ":*" not in text and public_text(legacy) in text
    new_lines = trusted_lines(site, alice, tmp_path)
    assert public_text(legacy) in new_lines.read_text()
    result = openssh(site, new_lines, alice.ssh_port)
    assert result.returncode == 0, result.stderr

    # extended: signed again by the old CA, so her known_hosts still reaches her session
    now = datetime.now(UTC)
    runtime.extend(alice.key, now + timedelta(hours=2))
    assert signer_of(folder / CERTIFICATE) == public_text(legacy).encode()
    result = openssh(site, old_line, alice.ssh_port)
    assert result.returncode == 0, result.stderr

    # her copy served by a host user elsewhere: refused by the lines printed now
    port = free_ports(1)
    with users_sshd(host_user, folder, port):
        assert refused(openssh(site, new_lines, port))

    # once her certificate is over, the old CA's line is no longer printed
    runtime.extend(alice.key, now - timedelta(minutes=10))
    assert ca.legacy_until(datetime.now(UTC)) is None
    assert public_text(legacy) not in ca.known_hosts_text()


def file_config(root: Path) -> Config:
    return parse_config(
        {"daemon": {"state_dir": str(root / "state")}, "hosts": [{"name": "localhost"}]}
    )


def test_a_certificate_is_signed_again_by_its_own_ca_or_not_at_all(tmp_path: Path) -> None:
    ca = HostCA(file_config(tmp_path))
    folder = tmp_path / "session" / "host-keys"
    folder.parent.mkdir()
    now = datetime.now(UTC)
    ca.issue_session_key(folder, 0, 0, "booking-1", now, now + timedelta(hours=1), 4242)
    # 4242 is none of the configured ports (taken out of the config while it ran):
    # its session is still signed again by the port's own CA
    assert 4242 not in ca.ports()
    ca.renew_session_certificate(folder, "booking-1", now, now + timedelta(hours=2))
    assert signer_of(folder / CERTIFICATE) == ca.public_line(4242).encode()
    # a certificate some other CA signed (a stranger's): never re-signed, even by a port's CA
    stranger = ed25519.Ed25519PrivateKey.generate()
    public = serialization.load_ssh_public_key((folder / PUBLIC).read_bytes())
    assert isinstance(public, ed25519.Ed25519PublicKey)
    (folder / CERTIFICATE).write_bytes(
        ca.sign(public, "x", now, now + timedelta(hours=1), stranger)
    )
    with pytest.raises(OSError, match="signed by no CA"):
        ca.renew_session_certificate(folder, "booking-1", now, now + timedelta(hours=2))
    (folder / CERTIFICATE).write_text("not a certificate\n")
    with pytest.raises(OSError):
        ca.renew_session_certificate(folder, "booking-1", now, now + timedelta(hours=2))


def test_the_output_service_leaves_the_old_ca_for_its_ports(tmp_path: Path) -> None:
    ca = HostCA(file_config(tmp_path))
    now = datetime.now(UTC)
    folder = ca.service_keys(now)
    sftp = ca.config.storage.sftp_port
    assert signer_of(folder / CERTIFICATE) == ca.public_line(sftp).encode()
    # certified by the single CA before an upgrade: signed again by its port's at once
    legacy = ed25519.Ed25519PrivateKey.generate()
    private = serialization.load_ssh_private_key((folder / HOST_KEY).read_bytes(), None)
    assert isinstance(private, ed25519.Ed25519PrivateKey)
    old = ca.sign(private.public_key(), "old", now, now + timedelta(days=30), legacy)
    (folder / CERTIFICATE).write_bytes(old)
    ca.service_keys(now)
    assert signer_of(folder / CERTIFICATE) == ca.public_line(sftp).encode()
    assert ca.public_line(sftp) not in {ca.public_line(port) for port in ca.ports()[:-1]}
