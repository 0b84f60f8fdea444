"""The output service on the real Docker engine: users fetch their outputs after the end.

Sessions run as in tests/test_runtime.py (userns-remap, the local base image);
users come back with paramiko's SFTP client, as they would with `sftp`, and
try everything a curious or hostile user would: another login's key, `..`,
links planted in their own output that point at /, at another user's folder
and at /etc/shadow, writing, a shell, port forwarding.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import ftplib
import hashlib
import io
import logging
import pwd
import socket
import ssl
import stat
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import docker.types
import paramiko
import pytest
from conftest import BASE_IMAGE, TEST_HOST, DockerHarness
from ftps_client import Ftps
from support import logins
from test_runtime import Site, free_block, host_login, make_site, run, running_output, ssh_login

from gpuresa.backends.engines.output_container import services_split
from gpuresa.backends.engines.output_service import OutputService
from gpuresa.config.sections import Config
from gpuresa.mail.notices import start_message
from gpuresa.model import Session
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.host_ca import HostCA
from gpuresa.outputs.messages import start_details
from gpuresa.outputs.owners import output_owner
from gpuresa.outputs.running_area import running_path
from gpuresa.sessions.labels import INSTALLATION_LABEL, ftp_name

__all__ = ["host_login"]  # a fixture of test_runtime.py, used here too


def with_storage(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, storage=dataclasses.replace(config.storage, **changes))


@pytest.fixture(scope="module")
def images(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build (or find) the session, FTP and output service images once for the module."""
    site = make_site(tmp_path_factory.mktemp("images"), docker_client)
    site.runtime().ensure_image("pytorch", None)
    site.runtime().ensure_ftp_image()
    OutputService(site.config, site.runtime()).ensure_image()


@pytest.fixture
def site(tmp_path: Path, docker_harness: DockerHarness, images: None) -> Site:
    made = make_site(tmp_path, docker_harness.client)
    made.config = with_storage(made.config, sftp_port=free_block(1))
    return made


def sftp_login(
    config: Config, login: str, key: paramiko.PKey
) -> contextlib.AbstractContextManager[paramiko.SFTPClient]:
    """A login to the host's output service (see `support.logins.sftp_login`)."""
    return logins.sftp_login(config.storage.sftp_port, login, key)


def read(sftp: paramiko.SFTPClient, path: str) -> bytes:
    with sftp.open(path, "rb") as stream:
        return bytes(stream.read())


def session_with_file(site: Site, login: str, text: str) -> Session:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, login))
    with ssh_login(session, login, site.key(login)) as client:
        assert run(client, f"echo {text} > /output/result.txt")[0] == 0
    return session


def test_a_user_downloads_their_output_after_the_end_and_nobody_else_can(site: Site) -> None:
    runtime = site.runtime()
    alice = session_with_file(site, "alice", "alice-secret")
    bob = session_with_file(site, "bob", "bob-secret")
    bob_folder = bob.output_dir.relative_to(site.root / "output").as_posix()
    with ssh_login(alice, "alice", site.key("alice")) as client:
        # links alice plants in her own output, as root of her session
        for target, name in (
            ("/", "to-root"),
            ("/etc/shadow", "to-shadow"),
            (f"../../{bob_folder}", "to-bob"),
            (f"/outputs/{bob_folder}", "to-bob-in-service"),
            (str(bob.output_dir), "to-bob-on-host"),
            ("/etc/gpuresa-outputs/keys/bob", "to-bob-keys"),
        ):
            assert run(client, f"sudo -n ln -s {target} /output/{name}")[0] == 0
    for session in (alice, bob):
        runtime.stop(session.key, grace=timedelta(seconds=1))

    service = OutputService(site.config, runtime)
    state = service.ensure_running()
    assert state.action == "made" and set(state.logins) == {"alice", "bob"}
    alice_name = alice.output_dir.name

    with sftp_login(site.config, "alice", site.key("alice")) as sftp:
        # her chroot holds her outputs only
        assert sftp.listdir("/") == [alice_name]
        assert sftp.listdir("/..") == [alice_name]
        assert sftp.normalize("../../..") == "/"
        assert read(sftp, f"/{alice_name}/result.txt") == b"alice-secret\n"
        # every planted link stays inside her chroot
        assert sftp.listdir(f"/{alice_name}/to-root") == [alice_name]
        for name in ("to-shadow", "to-bob", "to-bob-in-service", "to-bob-on-host", "to-bob-keys"):
            with pytest.raises(OSError):
                read(sftp, f"/{alice_name}/{name}")
            with pytest.raises(OSError):
                sftp.listdir(f"/{alice_name}/{name}")
        with pytest.raises(OSError):
            read(sftp, f"/{alice_name}/to-bob/result.txt")
        # read-only: nothing can be written, removed or renamed
        with pytest.raises(OSError):
            sftp.open(f"/{alice_name}/new.txt", "wb")
        with pytest.raises(OSError):
            sftp.remove(f"/{alice_name}/result.txt")
        with pytest.raises(OSError):
            sftp.mkdir("/new")

    with sftp_login(site.config, "bob", site.key("bob")) as sftp:
        assert sftp.listdir("/") == [bob.output_dir.name]
        assert read(sftp, f"/{bob.output_dir.name}/result.txt") == b"bob-secret\n"
        with pytest.raises(OSError):
            sftp.listdir(f"/../alice/{alice_name}")
        with pytest.raises(OSError):
            read(sftp, f"/../alice/{alice_name}/result.txt")

    # a key opens its own login only
    for login, key in (("alice", site.key("bob")), ("bob", site.key("alice"))):
        with pytest.raises(paramiko.AuthenticationException), sftp_login(site.config, login, key):
            pass
    # no root, no shell, no forwarding
    with (
        pytest.raises(paramiko.AuthenticationException),
        sftp_login(site.config, "root", site.key("alice")),
    ):
        pass
    client = logins.connect(site.config.storage.sftp_port, "alice", site.key("alice"))
    try:
        _, stdout, _ = client.exec_command("id; cat /etc/passwd", timeout=10)
        assert b"uid=" not in stdout.read()
        transport = client.get_transport()
        assert transport is not None
        with pytest.raises(paramiko.ChannelException):
            transport.open_channel("direct-tcpip", ("127.0.0.1", 22), ("127.0.0.1", 0), timeout=10)
    finally:
        client.close()

    # on the host: the login folder is root's and closed to others, the output the owner's
    owner = output_owner("alice", site.config)
    top = (site.root / "output" / "alice").stat()
    assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (0, owner.gid, 0o750)
    handed = alice.output_dir.stat()
    assert (handed.st_uid, handed.st_gid, stat.S_IMODE(handed.st_mode)) == (0, owner.gid, 0o750)
    assert (alice.output_dir / "to-root").is_symlink()  # links handed over, never followed
    assert Path("/etc/shadow").stat().st_uid == 0


def test_the_service_is_adopted_restarted_and_remade(site: Site) -> None:
    runtime = site.runtime()
    session = session_with_file(site, "alice", "first")
    runtime.stop(session.key, grace=timedelta(seconds=1))
    service = OutputService(site.config, runtime)
    assert service.ensure_running().action == "made"
    # a new daemon finds it running
    assert OutputService(site.config, site.runtime()).ensure_running().action == "running"
    container = service.find()
    assert container is not None
    settings = container["HostConfig"]
    assert settings["UsernsMode"] == "host" and not settings["Privileged"]
    assert settings["CapDrop"] == ["ALL"] and "no-new-privileges:true" in settings["SecurityOpt"]
    assert {mount["Target"]: mount["ReadOnly"] for mount in settings["Mounts"]}["/outputs"]
    # sshd itself keeps KILL (5), SETGID (6), SETUID (7) and SYS_CHROOT (18): not CHOWN
    sshd = "grep CapEff /proc/$(pgrep -o -x sshd)/status"
    code, output = site.client.containers.get(container["Id"]).exec_run(["sh", "-c", sshd])
    assert code == 0 and int(output.split()[1], 16) == (1 << 5) | (1 << 6) | (1 << 7) | (1 << 18)
    site.client.containers.get(container["Id"]).stop(timeout=1)
    assert service.ensure_running().action == "started"
    # a new port remakes it
    moved = with_storage(site.config, sftp_port=free_block(1))
    assert OutputService(moved, runtime).ensure_running().action == "made"
    with sftp_login(moved, "alice", site.key("alice")) as sftp:
        assert sftp.listdir("/") == [session.output_dir.name]


def test_another_installations_service_of_the_same_host_is_never_taken(
    site: Site, caplog: pytest.LogCaptureFixture
) -> None:
    """A test daemon beside the real one, both `gpu1` on one engine: each makes, keeps and
    removes its own output service; one made before the installation label is adopted (and
    remade) by the installation whose output root it serves, and by no other."""
    neighbour = make_site(site.root / "neighbour", site.client)
    neighbour.config = with_storage(neighbour.config, sftp_port=free_block(1))
    mine = OutputService(site.config, site.runtime())
    theirs = OutputService(neighbour.config, neighbour.runtime())
    assert mine.ensure_running().action == "made"
    made = mine.find()
    assert made is not None
    with caplog.at_level(logging.WARNING):
        assert theirs.find() is None
        assert theirs.ensure_running().action == "made"
    assert [r for r in caplog.records if "another installation's output service" in r.message]
    assert ids(mine) == [made["Id"]]
    assert mine.ensure_running().action == "running"
    theirs.remove()
    assert theirs.find() is None
    assert ids(mine) == [made["Id"]]

    # one made before the label: its installation's by the output root it serves
    mine.remove()
    assert made["Id"] not in [item.id for item in site.client.containers.list(all=True)]
    older = older_service(site, made)
    assert theirs.find() is None
    assert theirs.ensure_running().action == "made"
    assert site.client.containers.get(older.id).status == "created"  # left alone
    adopted = mine.find()
    assert adopted is not None and adopted["Id"] == older.id
    assert mine.ensure_running().action == "made"  # remade with the label
    assert older.id not in [item.id for item in site.client.containers.list(all=True)]
    remade = mine.find()
    assert remade is not None
    assert remade["Config"]["Labels"]["gpuresa.installation"] == mine.installation
    assert remade["Name"] == f"/gpuresa-{site.config.daemon.host}-outputs-{mine.installation[:8]}"
    theirs.remove()
    mine.remove()


def ids(service: OutputService) -> list[str]:
    found = service.find()
    return [] if found is None else [str(found["Id"])]


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_an_unlabelled_service_is_told_by_the_output_root_it_binds_on_either_engine(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """What each engine's `inspect` shows of a service made before the installation label
    (Podman shows no `HostConfig.Mounts`): its owner's by the output root it binds."""
    client = request.getfixturevalue(f"{engine}_client")
    root = tmp_path / "output"
    root.mkdir()
    container = client.containers.create(
        BASE_IMAGE, ["true"],
        labels={"gpuresa.host": TEST_HOST, "gpuresa.role": "outputs"},
        mounts=[docker.types.Mount("/outputs", str(root), type="bind", read_only=True)],
    )  # fmt: skip
    try:
        shown = client.api.inspect_container(container.id)
        assert services_split([shown], "0" * 24, root) == ([shown], [])
        assert services_split([shown], "0" * 24, tmp_path / "another") == ([], [shown])
        labelled = {**shown, "Config": {"Labels": {INSTALLATION_LABEL: "1" * 24}}}
        assert services_split([labelled], "0" * 24, root) == ([], [labelled])
    finally:
        container.remove(force=True)


def older_service(site: Site, made: dict[str, Any]) -> Any:
    """A service container as gpuresa made them before the installation label: the same
    payload, without the label, under the old name; not started."""
    labels = dict(made["Config"]["Labels"])
    # its payload's digest was of a payload without the label: never this one's
    del labels["gpuresa.installation"], labels["gpuresa.payload-hash"]
    settings = made["HostConfig"]
    mounts = [
        docker.types.Mount(m["Target"], m["Source"], type="bind", read_only=m["ReadOnly"])
        for m in settings["Mounts"]
    ]
    return site.client.containers.create(
        made["Config"]["Image"],
        labels=labels,
        mounts=mounts,
        name=f"gpuresa-{site.config.daemon.host}-outputs",
    )


def test_the_end_of_a_session_leaves_no_gap_before_sftp(site: Site) -> None:
    runtime = site.runtime()
    service = OutputService(site.config, runtime)
    session = session_with_file(site, "alice", "now")
    service.ensure_running()
    runtime.stop(session.key, grace=timedelta(seconds=1))
    # no ensure_running in between: the service serves it as soon as stop returns
    with sftp_login(site.config, "alice", site.key("alice")) as sftp:
        assert read(sftp, f"/{session.output_dir.name}/result.txt") == b"now\n"


def server_key(port: int) -> paramiko.PKey:
    transport = paramiko.Transport(socket.create_connection(("127.0.0.1", port), timeout=10))
    try:
        transport.start_client(timeout=10)
        return transport.get_remote_server_key()
    finally:
        transport.close()


def test_sessions_and_the_service_each_show_a_key_of_their_own_and_the_email_the_ca(
    site: Site,
) -> None:
    runtime = site.runtime()
    first = runtime.start(site.spec(runtime, "alice"))
    first_key = server_key(first.ssh_port)
    runtime.stop(first.key, grace=timedelta(seconds=1))
    second = runtime.start(site.spec(runtime, "alice"))
    second_key = server_key(second.ssh_port)
    # a new host key per session (OpenSSH trusts them through the CA: test_host_certificates.py)
    assert first_key.asbytes() != second_key.asbytes()

    service = OutputService(site.config, runtime)
    service.ensure_running()
    service_key = server_key(site.config.storage.sftp_port)
    assert service_key.asbytes() not in (first_key.asbytes(), second_key.asbytes())

    credentials = HostCredentials(site.config)
    _, body = start_message(
        second, "127.0.0.1", "UTC", details=start_details(site.config, second, "127.0.0.1")
    )
    for line in HostCA(site.config).known_hosts_text().splitlines():
        assert f"  {line}\n" in body
    digest = hashlib.sha256(second_key.asbytes()).digest()
    assert "SHA256:" + base64.b64encode(digest).decode().rstrip("=") not in body
    assert "sftp -P" in body
    assert credentials.tls_fingerprint() in body and len(credentials.tls_fingerprint()) == 95


def test_the_ftp_sidecar_speaks_tls_and_refuses_plain_ftp(site: Site) -> None:
    session = session_with_file(site, "alice", "over-tls")
    cafile = HostCredentials(site.config).tls_files()[0]
    # lftp resumes the control connection's TLS session on each data connection
    ftps = Ftps(session.ftp_port, session.ftp_user, session.ftp_password, cafile=cafile)
    assert ftps.download("result.txt") == b"over-tls\n"
    ftps.upload("uploaded.txt", b"up over tls\n")
    assert ftps.download("uploaded.txt") == b"up over tls\n"
    assert (running_output(site, session) / "uploaded.txt").read_bytes() == b"up over tls\n"
    # curl does as well (the certificate was checked above; it names the public host)
    curl = subprocess.run(
        ["curl", "--silent", "--show-error", "--ssl-reqd", "--insecure",
         "--ftp-pasv", "--max-time", "30", "--netrc-file", "/dev/stdin",
         f"ftp://127.0.0.1:{session.ftp_port}/result.txt"],
        input=f"machine 127.0.0.1 login {session.ftp_user} password {session.ftp_password}\n",
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (curl.returncode, curl.stdout) == (0, "over-tls\n"), curl.stderr

    plain = ftplib.FTP()
    plain.connect("127.0.0.1", session.ftp_port, timeout=10)
    with pytest.raises(ftplib.error_perm, match="530"):
        plain.login(session.ftp_user, session.ftp_password)
    plain.close()


def test_a_data_connection_that_does_not_resume_the_tls_session_is_refused(site: Site) -> None:
    """Who races for the passive port from the same address has a TLS session of its
    own: Python's ftplib is such a client (it opens a fresh TLS session for data)."""
    session = session_with_file(site, "alice", "secret output")
    context = ssl.create_default_context(cafile=str(HostCredentials(site.config).tls_files()[0]))
    context.check_hostname = False  # the certificate names the host's public name
    refused = (ftplib.Error, ssl.SSLError, OSError, EOFError)
    # what vsftpd runs with: TLS session reuse, passive data from the control's address
    sidecar = site.client.containers.get(ftp_name(session.host, session.key))
    code, effective = sidecar.exec_run(["cat", "/etc/vsftpd-gpuresa.conf"])
    settings = effective.decode().splitlines()
    assert code == 0 and "require_ssl_reuse=YES" in settings
    assert "pasv_promiscuous=NO" in settings and "pasv_promiscuous=YES" not in settings

    def logged_in() -> ftplib.FTP_TLS:
        ftps = ftplib.FTP_TLS(context=context)
        ftps.trust_server_pasv_ipv4_address = True  # type: ignore[attr-defined]
        ftps.connect("127.0.0.1", session.ftp_port, timeout=10)
        ftps.login(session.ftp_user, session.ftp_password)
        ftps.prot_p()
        return ftps

    received = io.BytesIO()
    ftps = logged_in()
    with pytest.raises(refused) as download:
        ftps.retrbinary("RETR result.txt", received.write)
    assert received.getvalue() == b""
    assert "522" in str(download.value), download.value
    ftps.close()
    ftps = logged_in()
    with pytest.raises(refused):
        ftps.storbinary("STOR planted.txt", io.BytesIO(b"planted\n"))
    ftps.close()
    planted = running_output(site, session) / "planted.txt"
    assert not planted.exists() or planted.read_bytes() == b""


def test_plain_ftp_is_accepted_when_the_config_asks(site: Site) -> None:
    site.config = with_storage(site.config, ftp_plain=True)
    session = session_with_file(site, "alice", "plain")
    plain = ftplib.FTP()
    plain.trust_server_pasv_ipv4_address = True  # type: ignore[attr-defined]
    plain.connect("127.0.0.1", session.ftp_port, timeout=10)
    plain.login(session.ftp_user, session.ftp_password)
    buffer = io.BytesIO()
    plain.retrbinary("RETR result.txt", buffer.write)
    assert buffer.getvalue() == b"plain\n"
    plain.quit()


def test_the_service_waits_for_a_new_login_without_restarting(site: Site) -> None:
    runtime = site.runtime()
    service = OutputService(site.config, runtime)
    first = session_with_file(site, "alice", "a")
    runtime.stop(first.key, grace=timedelta(seconds=1))
    service.ensure_running()
    started = service.find()
    second = session_with_file(site, "bob", "b")
    runtime.stop(second.key, grace=timedelta(seconds=1))
    deadline = time.monotonic() + 5
    assert service.ensure_running().action == "running"
    assert time.monotonic() < deadline + 30
    found = service.find()
    assert started is not None and found is not None and found["Id"] == started["Id"]
    with sftp_login(site.config, "bob", site.key("bob")) as sftp:
        assert sftp.listdir("/") == [second.output_dir.name]


def test_sftp_inside_a_session_reads_and_writes_the_output(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    client = logins.connect(session.ssh_port, "alice", site.key("alice"))
    try:
        sftp = client.open_sftp()
        with sftp.open("/output/over-sftp.txt", "wb") as stream:
            stream.write(b"written over sftp\n")
        assert read(sftp, "/output/over-sftp.txt") == b"written over sftp\n"
        assert "dataset.csv" in sftp.listdir("/data")
        sftp.close()
    finally:
        client.close()
    written = running_path(site.config, session.key) / "over-sftp.txt"
    assert written.read_bytes() == b"written over sftp\n"


def test_a_host_account_gets_its_output_and_the_service_serves_it(
    site: Site, host_login: str
) -> None:
    (site.root / "keys" / "alice.pub").rename(site.root / "keys" / f"{host_login}.pub")
    (site.root / "private" / "alice").rename(site.root / "private" / host_login)
    account = pwd.getpwnam(host_login)
    session = session_with_file(site, host_login, "mine")
    site.runtime().stop(session.key, grace=timedelta(seconds=1))
    # root's, read-only to the host account's own group, the login folder closed to others
    details = (session.output_dir / "result.txt").stat()
    assert (details.st_uid, details.st_gid) == (0, account.pw_gid)
    assert stat.S_IMODE(details.st_mode) == 0o640
    top = session.output_dir.parent.stat()
    assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (0, account.pw_gid, 0o750)
    OutputService(site.config, site.runtime()).ensure_running()
    with sftp_login(site.config, host_login, site.key(host_login)) as sftp:
        assert session.output_dir.name in sftp.listdir("/")
        assert sftp.listdir(f"/{session.output_dir.name}") == ["result.txt"]
        assert read(sftp, f"/{session.output_dir.name}/result.txt") == b"mine\n"
