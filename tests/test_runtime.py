"""Sessions on the real engines, Docker (userns-remap) and Podman (userns=auto), built on
the local base image.

What an engine does (logins, FTP, mounts, confinement, stop, adoption, GPU
devices) is tested on both, through the `site` fixture; what gpuresa decides
or keeps on the host (refused requests, commands, messages, new end times) on
Docker alone, through `docker_site`, to keep the suite short.

Each test gets a site of its own in tmp_path (keys, input, output, state) and
free port ranges on 127.0.0.1; every container and network carries the test
host's label, so `docker_harness` removes them and prints their logs when a
test fails. Users log in with paramiko and fetch files with lftp (FTPS), as a
person would with ssh and an FTP client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import paramiko
import pytest
from conftest import BASE_IMAGE, PODMAN_SOCKET, TEST_HOST, DockerHarness, run_login
from ftps_client import Ftps, FtpsError
from support import logins
from support.configs import free_ports
from support.gpu_nodes import stand_in_driver, stand_in_gpu_nodes
from support.logins import run as run  # for the tests that log in to sessions of this site
from support.waiting import wait_for

from gpuresa.backends.engines import Runtime, processes, stopping
from gpuresa.backends.engines.engine import Engine, EngineRefused
from gpuresa.backends.engines.namespaces import require_user_namespaces
from gpuresa.cli import main
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.homes.paths import view_path
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.folder import remap_base
from gpuresa.outputs.running_area import running_path
from gpuresa.planning.allocation import AllocationError
from gpuresa.sessions.errors import RuntimeUnavailable, SessionError
from gpuresa.sessions.labels import session_name

LOGINS = ("alice", "bob")


# --- a site of the test's own -----------------------------------------------------------------


def port_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:port (connections in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_block(size: int) -> int:
    """The first of `size` consecutive ports free on 127.0.0.1, below the ephemeral range
    (see `support.configs.free_ports`)."""
    return free_ports(size)


@dataclass
class Site:
    """One test's gpuresa site: its config, its files and its users' keys."""

    root: Path
    config: Config
    client: Any

    @property
    def engine(self) -> str:
        return self.config.host().engine

    @property
    def inputs(self) -> Path:
        return self.root / "input"

    def key(self, login: str) -> paramiko.PKey:
        return paramiko.Ed25519Key.from_private_key_file(str(self.root / "private" / login))

    def runtime(self) -> Runtime:
        return Runtime(self.config, self.client)

    def spec(
        self, runtime: Runtime, user: str = "alice", template: str = "pytorch", **options: Any
    ) -> SessionSpec:
        end = options.pop("end", datetime.now(UTC) + timedelta(hours=1))
        return runtime.new_spec(user, template, end, **options)


def make_site(
    root: Path,
    client: Any,
    *,
    sessions: int = 4,
    gpu_mode: str = "none",
    gpus: list[int] | None = None,
    engine: str = "docker",
    storage: dict[str, Any] | None = None,
    **host: Any,
) -> Site:
    for folder in ("keys", "private", "input", "output", "state"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "input" / "dataset.csv").write_text("x,y\n1,2\n")
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "private" / "spare")],
        check=True,
    )
    for login in LOGINS:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{login}@test",
             "-f", str(root / "private" / login)],
            check=True,
        )  # fmt: skip
        (root / "private" / f"{login}.pub").rename(root / "keys" / f"{login}.pub")
    # a second key line, with options, as authorized_keys files often have
    spare = (root / "private" / "spare.pub").read_text()
    with (root / "keys" / "alice.pub").open("a") as keys:
        keys.write(f"# spare key\nno-agent-forwarding,no-X11-forwarding {spare}")
    passive_per_session = 3
    first = free_block(sessions * (2 + passive_per_session))
    ssh_last = first + sessions - 1
    ftp_last = ssh_last + sessions
    data = {
        "daemon": {"host": TEST_HOST, "state_dir": str(root / "state")},
        "hosts": [
            {
                "name": TEST_HOST,
                "engine": engine,
                **({"engine_socket": PODMAN_SOCKET} if engine == "podman" else {}),
                "gpus": gpus if gpus is not None else [],
                "gpu_mode": gpu_mode,
                "bind_address": "127.0.0.1",
                "ssh_ports": f"{first}-{ssh_last}",
                "ftp_ports": f"{ssh_last + 1}-{ftp_last}",
                "ftp_passive_ports": f"{ftp_last + 1}-{ftp_last + sessions * passive_per_session}",
                "ftp_passive_per_session": passive_per_session,
                **host,
            }
        ],
        "templates": {"base_image": BASE_IMAGE},
        "users": {"keys_dir": str(root / "keys"), "host_authorized_keys": False},
        "storage": {
            "output_root": str(root / "output"),
            "inputs": [{"source": str(root / "input"), "target": "/data"}],
            **(storage or {}),
        },
        "limits": {"shm_size": "256m", "pids": 512},
    }
    return Site(root, parse_config(data, str(root / "config.toml")), client)


@pytest.fixture(scope="module", name="built")
def built_fixture(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[DockerHarness], None]]:
    """Build (or find) the images once per engine for the module, so no test waits for one."""
    engines: set[str] = set()

    def build(harness: DockerHarness) -> None:
        if harness.engine in engines:
            return
        root = tmp_path_factory.mktemp(f"images-{harness.engine}")
        site = make_site(root, harness.client, engine=harness.engine)
        site.runtime().ensure_image("pytorch", None)
        site.runtime().ensure_ftp_image()
        engines.add(harness.engine)

    yield build


@pytest.fixture(scope="module")
def images(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build (or find) the Docker images once for the module (for modules that import it)."""
    site = make_site(tmp_path_factory.mktemp("images"), docker_client)
    site.runtime().ensure_image("pytorch", None)
    site.runtime().ensure_ftp_image()


@pytest.fixture(name="site")
def site_fixture(
    tmp_path: Path, engine_harness: DockerHarness, built: Callable[[DockerHarness], None]
) -> Site:
    """A site on each engine in turn."""
    built(engine_harness)
    return make_site(tmp_path, engine_harness.client, engine=engine_harness.engine)


@pytest.fixture
def docker_site(tmp_path: Path, docker_harness: DockerHarness, images: None) -> Site:
    """A site on Docker, for what does not depend on the engine."""
    return make_site(tmp_path, docker_harness.client)


def host_uid(site: Site, session: Session, uid: int) -> int:
    """The host uid of container uid `uid` in `session`, checked against the engine."""
    assert session.id_range is not None, "sessions must run in a user namespace"
    if site.engine == "docker":
        # every Docker session shares userns-remap's range
        assert session.id_range.uid == remap_base(site.client.info())[0] > 0
    else:
        assert session.id_range.uid >= 2000000  # from the `containers` range setup gives
    return session.id_range.uid + uid


# --- how users get in -------------------------------------------------------------------------


def running_output(site: Site, session: Session | SessionSpec) -> Path:
    """Where a running session's output is on the host (root-only until the hand-over)."""
    return running_path(site.config, session.key)


def ssh_login(
    session: Session, login: str, key: paramiko.PKey | None = None, password: str | None = None
) -> contextlib.AbstractContextManager[paramiko.SSHClient]:
    """A login to `session`'s sshd (see `support.logins.ssh_login`)."""
    return logins.ssh_login(session.ssh_port, login, key, password=password)


@contextlib.contextmanager
def ftp_login(session: Session, user: str, password: str) -> Iterator[Ftps]:
    """FTPS, as sidecars require, logged in; the certificate itself is checked in
    test_outputs_service.py. Raises `FtpsError` when the login is refused."""
    ftp = Ftps(session.ftp_port, user, password)
    ftp.login()
    yield ftp


def download(ftp: Ftps, name: str) -> bytes:
    return ftp.download(name)


def leftovers(site: Site, key: str) -> list[str]:
    """Names of the Docker objects still there for session `key`."""
    labels = {"label": [f"gpuresa.host={TEST_HOST}", f"gpuresa.reservation={key}"]}
    containers = site.client.containers.list(all=True, filters=labels)
    networks = site.client.networks.list(filters={"name": session_name(TEST_HOST, key)})
    return [item.name for item in [*containers, *networks]]


# --- one session ------------------------------------------------------------------------------


def test_a_session_gives_ssh_with_sudo_inputs_and_ftp(site: Site) -> None:
    runtime = site.runtime()
    spec = site.spec(runtime)
    session = runtime.start(spec)
    assert session.state == "running"
    assert (session.ssh_port, session.ftp_port) == (spec.ssh_port, spec.ftp_port)

    with ssh_login(session, "alice", site.key("alice")) as client:
        code, output = run(client, "id -un; sudo -n id -u; sudo -n id -un")
        assert (code, output.split()) == (0, ["alice", "0", "root"])
        # the input is there and read-only, even for root
        assert run(client, "cat /data/dataset.csv") == (0, "x,y\n1,2\n")
        code, output = run(client, "sudo -n touch /data/new 2>&1")
        assert code != 0 and "Read-only file system" in output
        assert run(client, "echo from-ssh > /output/from-ssh.txt")[0] == 0
        # the session names its GPUs (none here) for CUDA and the NVIDIA runtime
        assert run(client, "echo $NVIDIA_VISIBLE_DEVICES")[1].strip() == "void"
        # both keys arrived; no key line leaked into the login environment
        assert run(client, "wc -l < /etc/gpuresa/session/authorized_keys")[1].strip() == "2"
        environment = run(client, "cat /etc/environment")[1]
        assert "NVIDIA_VISIBLE_DEVICES=" in environment and "ssh-ed25519" not in environment
        assert "GPURESA_" not in environment

    with ftp_login(session, session.ftp_user, session.ftp_password) as ftp:
        assert download(ftp, "from-ssh.txt") == b"from-ssh\n"
        ftp.upload("from-ftp.txt", b"from-ftp\n")
        # chrooted: the output folder is all there is
        assert ftp.names("/..") == ["from-ftp.txt", "from-ssh.txt"]

    with ssh_login(session, "alice", site.key("alice")) as client:
        assert run(client, "cat /output/from-ftp.txt") == (0, "from-ftp\n")
        code, owners = run(client, "stat -c %U /output/from-ftp.txt /output/from-ssh.txt")
        assert owners.split() == ["alice", "alice"]

    # on the host, the output belongs to the container user's remapped uid
    uid = int(site.client.containers.get(session.containers[0]).labels["gpuresa.uid"])
    for name in ("from-ssh.txt", "from-ftp.txt"):
        written = running_output(site, session) / name
        assert written.stat().st_uid == host_uid(site, session, uid)
    assert session.output_dir.is_relative_to(site.root / "output" / "alice")


def test_the_containers_are_confined(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    main_container = site.client.containers.get(session.containers[0])
    settings = main_container.attrs["HostConfig"]
    assert settings["Privileged"] is False
    if site.engine == "docker":
        assert settings["CapDrop"] == ["ALL"]
    else:
        # Podman lists what it dropped of its defaults rather than "ALL"
        assert {"AUDIT_WRITE", "FSETID", "NET_BIND_SERVICE", "SETFCAP", "SETPCAP"} <= set(
            settings["CapDrop"]
        )
    assert settings["ShmSize"] == 256 * 1024**2
    assert settings["PidsLimit"] == 512
    mounts = {mount["Destination"]: mount for mount in main_container.attrs["Mounts"]}
    assert set(mounts) == {
        "/data", "/output", "/etc/gpuresa/session", "/etc/ssh/gpuresa-host-keys", "/home/alice"
    }  # fmt: skip
    assert mounts["/data"]["RW"] is False and mounts["/output"]["RW"] is True
    # the login's lasting home: its own view, nothing else of the homes' folder
    assert mounts["/home/alice"]["RW"] is True
    assert mounts["/home/alice"]["Source"] == str(view_path(site.config, "alice", session.key))
    # the session's files are written on the host; the session may only read them
    assert mounts["/etc/gpuresa/session"]["RW"] is False
    assert mounts["/etc/ssh/gpuresa-host-keys"]["RW"] is False
    with ssh_login(session, "alice", site.key("alice")) as client:
        # root through sudo keeps only the capabilities sshd and sudo need
        code, output = run(client, "sudo -n grep CapEff /proc/self/status")
        effective = int(output.split()[1], 16)
        # CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, KILL 5, SETGID 6, SETUID 7, SYS_CHROOT 18
        assert code == 0 and effective == 0x400EB
        # and cannot make device nodes or mount things
        assert run(client, "sudo -n mknod /tmp/node c 1 3")[0] != 0
        assert run(client, "sudo -n mount -t tmpfs none /mnt")[0] != 0
        # no Docker socket anywhere
        assert run(client, "ls /var/run/docker.sock /run/docker.sock")[0] != 0
        # one host key, the session's own from the host with its certificate; none in the image
        assert run(client, "ls /etc/ssh/ | grep -c '^ssh_host_.*_key$'")[1].strip() == "0"
        assert run(client, "sudo -n ls /etc/ssh/gpuresa-host-keys")[1].split() == [
            "ssh_host_ed25519_key",
            "ssh_host_ed25519_key-cert.pub",
            "ssh_host_ed25519_key.pub",
        ]


# --- two sessions -----------------------------------------------------------------------------


def test_two_sessions_are_kept_apart(site: Site) -> None:
    runtime = site.runtime()
    first = runtime.start(site.spec(runtime, "alice"))
    second = runtime.start(site.spec(runtime, "bob"))
    ports_first, ports_second = (
        {session.ssh_port, session.ftp_port}
        | set(range(session.ftp_passive_first, session.ftp_passive_last + 1))
        for session in (first, second)
    )
    assert not ports_first & ports_second
    assert first.output_dir != second.output_dir

    with ssh_login(first, "alice", site.key("alice")) as client:
        run(client, "echo alice > /output/alice.txt")
    with ssh_login(second, "bob", site.key("bob")) as client:
        run(client, "echo bob > /output/bob.txt")
        # bob's session shows bob's output only
        assert run(client, "ls /output")[1].split() == ["bob.txt"]
        assert run(client, f"sudo -n ls {first.output_dir} 2>&1")[0] != 0

    # a key only opens its own login's session
    for session, login, key in (
        (second, "bob", site.key("alice")),
        (second, "alice", site.key("alice")),
        (first, "alice", site.key("bob")),
        (first, "bob", site.key("bob")),
    ):
        with pytest.raises(paramiko.AuthenticationException), ssh_login(session, login, key):
            pass
    # no password works over SSH, not even the session's FTP password
    with (
        pytest.raises(paramiko.AuthenticationException),
        ssh_login(first, "alice", password=first.ftp_password),
    ):
        pass
    # a session's FTP password opens that session's output only
    assert first.ftp_password != second.ftp_password
    with pytest.raises(FtpsError), ftp_login(second, second.ftp_user, first.ftp_password):
        pass
    with pytest.raises(FtpsError), ftp_login(first, second.ftp_user, second.ftp_password):
        pass
    with ftp_login(first, first.ftp_user, first.ftp_password) as ftp:
        assert ftp.names() == ["alice.txt"]


# --- stop, adopt, idempotence -----------------------------------------------------------------


def test_stop_removes_everything_but_the_output(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    with ssh_login(session, "alice", site.key("alice")) as client:
        run(client, "echo result > /output/result.txt")
    started = time.monotonic()
    runtime.stop(session.key, timedelta(seconds=5))
    assert time.monotonic() - started < 5
    assert leftovers(site, session.key) == []
    assert runtime.list_sessions() == []
    for port in (session.ssh_port, session.ftp_port, session.ftp_passive_first):
        assert port_free(port), f"port {port} is still bound"
    assert (session.output_dir / "result.txt").read_text() == "result\n"
    # stopping again, or a session that never was, is fine
    runtime.stop(session.key, timedelta(seconds=5))
    runtime.stop("no-such-session", timedelta(0))
    # and the freed ports go to the next session
    assert site.spec(runtime).ssh_port == session.ssh_port


@pytest.fixture
def host_login() -> Iterator[str]:
    """A throw-away account on this host (removed afterwards), as a real user would have."""
    login = run_login("gtest")
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", login], check=True
    )
    try:
        yield login
    finally:
        subprocess.run(["userdel", login], check=False)


def test_stop_hands_the_output_read_only_to_the_users_host_account(
    tmp_path: Path, site: Site, host_login: str
) -> None:
    site = make_site(tmp_path / "own", site.client, engine=site.engine)
    site = Site(
        site.root,
        dataclasses.replace(
            site.config,
            storage=dataclasses.replace(site.config.storage, hand_output_to_user=True),
        ),
        site.client,
    )
    (site.root / "keys" / "alice.pub").rename(site.root / "keys" / f"{host_login}.pub")
    (site.root / "private" / "alice").rename(site.root / "private" / host_login)
    account = pwd.getpwnam(host_login)
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, host_login))
    with ssh_login(session, host_login, site.key(host_login)) as client:
        # the login has the same uid inside as on the host
        assert run(client, "id -u")[1].strip() == str(account.pw_uid)
        run(client, "mkdir /output/run1 && echo done > /output/run1/log.txt")
    log_owner = (running_output(site, session) / "run1" / "log.txt").stat().st_uid
    assert log_owner == host_uid(site, session, account.pw_uid)
    runtime.stop(session.key, timedelta(seconds=2))
    # root's, readable through the login's own (private) group, writable by nobody else
    for path, mode in (
        (session.output_dir, 0o750),
        (session.output_dir / "run1", 0o750),
        (session.output_dir / "run1" / "log.txt", 0o640),
    ):
        details = path.stat()
        assert (details.st_uid, details.st_gid, stat.S_IMODE(details.st_mode)) == (
            0, account.pw_gid, mode,
        )  # fmt: skip
    # the login, on the host (its own process, given the folder: pytest's tree is root's)
    folder = os.open(session.output_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        output = f"/dev/fd/{folder}"
        as_login = ["setpriv", f"--reuid={host_login}", f"--regid={host_login}", "--init-groups"]

        def as_user(script: str) -> subprocess.CompletedProcess[str]:
            command = [*as_login, "sh", "-c", script]
            return subprocess.run(command, capture_output=True, text=True, pass_fds=(folder,))

        read = as_user(f"cat {output}/run1/log.txt")
        assert read.stdout == "done\n", read.stderr
        for attempt in (f"echo more >> {output}/run1/log.txt", f"fallocate -l 3G {output}/more"):
            wrote = as_user(attempt)
            assert wrote.returncode != 0 and "Permission denied" in wrote.stderr, attempt
    finally:
        os.close(folder)
    assert (session.output_dir / "run1" / "log.txt").read_text() == "done\n"
    assert not (session.output_dir / "more").exists()


def test_stop_gives_the_users_processes_their_grace(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    with ssh_login(session, "alice", site.key("alice")) as client:
        # a training job that saves its state when asked to stop
        client.exec_command(
            'nohup sh -c \'trap "sleep 1; echo saved > /output/checkpoint; exit 0" TERM; '
            "touch /tmp/trap-set; while true; do sleep 0.1; done' >/dev/null 2>&1 &"
        )
        wait_for(lambda: run(client, "test -e /tmp/trap-set")[0] == 0, 15, "the job's trap")
    runtime.stop(session.key, timedelta(seconds=10))
    assert (session.output_dir / "checkpoint").read_text() == "saved\n"
    assert leftovers(site, session.key) == []


def test_a_new_runtime_adopts_sessions_and_start_is_idempotent(site: Site) -> None:
    runtime = site.runtime()
    spec = site.spec(runtime)
    prepared = runtime.prepare(spec)
    assert prepared.state == "created"
    assert runtime.prepare(spec) == prepared
    # prepared ahead, its sshd answers but lets nobody in before the start
    with pytest.raises(paramiko.SSHException), ssh_login(prepared, "alice", site.key("alice")):
        pass
    # starting it only opens the gate: the daemon wants SSH within 2 s of the start time
    started = time.monotonic()
    running = runtime.start(spec)
    assert time.monotonic() - started < 0.5
    assert running.state == "running"
    # a restarted daemon sees the same session, password included
    adopted = Runtime(site.config, site.client).list_sessions()
    assert len(adopted) == 1
    assert adopted[0] == running
    assert adopted[0].ftp_password == running.ftp_password and running.ftp_password
    # starting it again returns it and makes nothing new
    again = Runtime(site.config, site.client).start(spec)
    assert again.containers == running.containers
    assert sorted(leftovers(site, spec.key)) == sorted(
        [*running.containers, session_name(TEST_HOST, spec.key)]
    )
    with ssh_login(again, "alice", site.key("alice")) as client:
        assert run(client, "true")[0] == 0


def test_a_stopped_session_is_listed_as_stopped_and_started_afresh(site: Site) -> None:
    runtime = site.runtime()
    spec = site.spec(runtime)
    session = runtime.start(spec)
    site.client.containers.get(session.containers[0]).kill()
    (listed,) = runtime.list_sessions()
    assert listed.state == "stopped"
    restarted = runtime.start(spec)
    assert restarted.state == "running"
    with ssh_login(restarted, "alice", site.key("alice")) as client:
        assert run(client, "true")[0] == 0


# --- refused requests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"template": "caffe"}, "template 'caffe' is not allowed"),
        ({"template": "../pytorch"}, "not a template name"),
        ({"cuda": "7.5"}, "no CUDA variant '7.5'"),
        ({"user": "alice/../root"}, "not a valid login"),
        ({"user": "root"}, "system account"),
        ({"user": "carol"}, "no SSH public key for login 'carol'"),
        ({"gpu_count": 1, "gpu_indices": (7,)}, "has no GPU 7"),
        ({"host": "elsewhere"}, "is for host 'elsewhere'"),
        ({"ssh_port": 22}, "SSH port 22 is outside"),
    ],
)
def test_a_bad_request_fails_clearly_and_leaves_nothing(
    docker_site: Site, change: dict[str, Any], reason: str
) -> None:
    site = docker_site
    runtime = site.runtime()
    spec = dataclasses.replace(site.spec(runtime), **change)
    with pytest.raises(SessionError, match=reason.replace("(", r"\(").replace(".", r"\.")):
        runtime.start(spec)
    assert leftovers(site, spec.key) == []
    assert list((site.root / "output").iterdir()) == []
    assert runtime.list_sessions() == []


def without_user_namespaces(info: dict[str, Any]) -> dict[str, Any]:
    """A copy of `docker info` as an engine without userns-remap would give it."""
    options = [
        option
        for option in info.get("SecurityOptions") or []
        if "userns" not in option and "rootless" not in option
    ]
    return {**info, "SecurityOptions": options}


def test_only_an_engine_with_user_namespaces_is_accepted(docker_harness: DockerHarness) -> None:
    info = docker_harness.client.info()
    require_user_namespaces(info)  # the test engine runs with userns-remap
    with pytest.raises(SessionError, match="runs without user namespaces; set userns-remap"):
        require_user_namespaces(without_user_namespaces(info))
    # a rootless engine is as safe; old engines named options without "name="
    require_user_namespaces({"SecurityOptions": ["name=seccomp,profile=default", "name=rootless"]})
    require_user_namespaces({"SecurityOptions": ["apparmor", "userns"]})
    with pytest.raises(SessionError):
        require_user_namespaces({"SecurityOptions": ["name=seccomp,profile=userns.json"]})
    with pytest.raises(SessionError):
        require_user_namespaces({})


def test_no_session_is_made_on_an_engine_without_user_namespaces(
    docker_site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = docker_site
    runtime = site.runtime()
    stripped = without_user_namespaces(runtime.engine.info())
    monkeypatch.setattr(runtime.engine, "info", lambda: stripped)
    spec = site.spec(runtime)
    for make in (runtime.prepare, runtime.start):
        with pytest.raises(SessionError, match="without user namespaces"):
            make(spec)
    assert leftovers(site, spec.key) == []
    assert list((site.root / "output").iterdir()) == []


def test_gpus_the_host_does_not_have_are_refused_when_asked_for(
    tmp_path: Path, docker_harness: DockerHarness, images: None
) -> None:
    site = make_site(tmp_path, docker_harness.client, gpu_mode="nvidia", gpus=[0, 1])
    runtime = site.runtime()
    with pytest.raises(SessionError, match="has no GPU 2"):
        site.spec(runtime, gpus=(1, 2))
    with pytest.raises(SessionError, match="3 GPU"):
        site.spec(runtime, gpus=3)
    assert site.spec(runtime, gpus=2).gpu_indices == (0, 1)


def test_an_exhausted_port_range_is_refused(
    tmp_path: Path, docker_harness: DockerHarness, images: None
) -> None:
    site = make_site(tmp_path, docker_harness.client, sessions=1)
    runtime = site.runtime()
    runtime.start(site.spec(runtime, "alice"))
    with pytest.raises(AllocationError, match="every SSH port"):
        site.spec(runtime, "bob")
    assert len(runtime.list_sessions()) == 1


def test_a_sidecar_that_cannot_start_rolls_the_session_back(site: Site) -> None:
    runtime = site.runtime()
    spec = site.spec(runtime)
    with socket.socket() as squatter:
        # something else holds one of the session's passive FTP ports
        squatter.bind(("127.0.0.1", spec.ftp_passive_last))
        squatter.listen()
        with pytest.raises(SessionError, match="did not start") as caught:
            runtime.start(spec)
    assert str(spec.ftp_passive_last) in str(caught.value)
    assert leftovers(site, spec.key) == []
    # free once the rollback returns: on Podman the containers' conmon holds their host
    # ports until it exits, after the removal; the runtime waits for it
    for port in (spec.ssh_port, spec.ftp_port):
        assert port_free(port)
    # the output folder is kept for a later try, where only root reaches it
    assert running_output(site, spec).is_dir()


def test_a_stop_returns_once_the_engine_has_let_go_of_the_ports(
    tmp_path: Path, podman_harness: DockerHarness, built: Callable[[DockerHarness], None]
) -> None:
    built(podman_harness)
    site = make_site(tmp_path, podman_harness.client, engine="podman")
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    ids = {str(container.id) for container in podman_harness.ours()}
    # Podman's conmon holds the session's host ports (its port reservation)
    keepers = processes.port_keepers(ids)
    assert len(keepers) == 2
    assert not port_free(session.ssh_port)
    runtime.stop(session.key, timedelta(0))
    assert processes.wait_exited(keepers, 0) == set()
    assert port_free(session.ssh_port) and port_free(session.ftp_port)


def test_a_removal_waits_for_the_engines_ports_not_for_another_programs() -> None:
    with socket.socket() as squatter, socket.socket() as engine_like:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        engine_like.bind(("127.0.0.1", 0))
        engine_like.listen()
        held = [("127.0.0.1", squatter.getsockname()[1]), ("127.0.0.1", 1)]
        # this test's own listener (comm "python…") is another program: nothing to wait for;
        # a port with no listener seen here may be the engine's (another namespace's)
        assert stopping.engine_held(held) == [("127.0.0.1", 1)]
        port = engine_like.getsockname()[1]
        assert processes.listening_programs({port}) == {
            port: {Path("/proc/self/comm").read_text().strip()}
        }
        engine = {*stopping.ENGINE_PROGRAMS, Path("/proc/self/comm").read_text().strip()}
        with mock.patch.object(stopping, "ENGINE_PROGRAMS", frozenset(engine)):
            assert stopping.engine_held([("127.0.0.1", port)]) == [("127.0.0.1", port)]


# --- moving the end, messages -----------------------------------------------------------------


def test_extend_moves_the_end_in_the_listing_and_the_banner(docker_site: Site) -> None:
    site = docker_site
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    later = (session.end + timedelta(hours=2)).replace(microsecond=0)
    runtime.extend(session.key, later)
    (listed,) = Runtime(site.config, site.client).list_sessions()
    assert listed.end == later
    with ssh_login(session, "alice", site.key("alice")) as client:
        banner = client.get_transport().get_banner()  # type: ignore[union-attr]
        assert banner is not None and f"{later:%Y-%m-%d %H:%M}".encode() in banner
        assert run(client, "cat /etc/gpuresa/end")[1].strip() == f"{later:%Y-%m-%dT%H:%M:%SZ}"
        assert f"{later:%Y-%m-%d %H:%M}" in run(client, "cat /etc/motd")[1]
    runtime.stop(session.key, timedelta(0))
    # the record goes with the session
    assert list((site.root / "state" / "sessions").iterdir()) == []


def test_an_end_moved_before_the_start_shows_from_the_first_login(docker_site: Site) -> None:
    site = docker_site
    runtime = site.runtime()
    spec = site.spec(runtime)
    runtime.prepare(spec)
    earlier = (spec.end - timedelta(minutes=30)).replace(microsecond=0)
    runtime.extend(spec.key, earlier)
    session = runtime.start(spec)
    assert session.end == earlier
    with ssh_login(session, "alice", site.key("alice")) as client:
        assert run(client, "cat /etc/gpuresa/end")[1].strip() == f"{earlier:%Y-%m-%dT%H:%M:%SZ}"


def test_a_message_reaches_the_logged_in_user_and_never_fails(docker_site: Site) -> None:
    site = docker_site
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    # nobody logged in yet, a session that does not exist: no error
    runtime.message(session.key, "nobody reads this")
    runtime.message("no-such-session", "nor this")
    with ssh_login(session, "alice", site.key("alice")) as client:
        channel = client.invoke_shell()
        channel.settimeout(10)
        # the shell's first words (its prompt): its login is recorded by then, for `wall`
        wait_for(channel.recv_ready, 15, "the shell's prompt")
        runtime.message(session.key, "-- your session ends in 5 minutes: save your work --")
        received = b""
        deadline = time.monotonic() + 10
        while b"ends in 5 minutes" not in received and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, socket.timeout):
                received += channel.recv(4096)
        assert b"your session ends in 5 minutes" in received


# --- GPUs without a toolkit: the devices mode, with stand-in nodes ----------------------------


@pytest.fixture
def stand_in_gpus() -> Iterator[dict[str, int]]:
    """Character devices at NVIDIA's paths, made only where none exists (see support.gpu_nodes)."""
    with stand_in_gpu_nodes() as numbers:
        yield numbers


def test_devices_mode_passes_the_booked_gpu_only(
    tmp_path: Path, site: Site, stand_in_gpus: dict[str, int]
) -> None:
    libraries, smi = stand_in_driver(tmp_path / "driver")
    site = make_site(
        tmp_path / "site",
        site.client,
        engine=site.engine,
        gpu_mode="devices",
        gpus=[0, 1],
        driver_libraries=[libraries],
        driver_binaries=[str(smi)],
    )
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, gpus=(1,)))
    assert session.gpu_indices == (1,)
    with ssh_login(session, "alice", site.key("alice")) as client:
        checks = (
            "test -c /dev/nvidia1 && test -c /dev/nvidiactl && test -c /dev/nvidia-uvm"
            " && ! test -e /dev/nvidia0 && echo devices-ok"
        )
        assert run(client, checks)[1].strip() == "devices-ok"
        assert run(client, "echo x > /dev/nvidia1 && echo writable")[1].strip() == "writable"
        assert run(client, "echo $NVIDIA_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES")[1].split() == [
            "1",
            "1",
        ]
        library = "/usr/local/nvidia/lib64/libnvidia-stand-in.so.1"
        assert run(client, f"cat {library}")[1] == "not really a library\n"
        assert run(client, f"sudo -n sh -c 'echo x >> {library}'")[0] != 0
        assert run(client, "nvidia-smi")[1].strip() == "stand-in GPU 1"
    runtime.stop(session.key, timedelta(0))


# --- the commands, and an engine that is away -------------------------------------------------


def test_session_commands_start_list_and_stop(
    docker_site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    site = docker_site
    config = site.root / "config.toml"
    config.write_text(_toml(site))
    code = main(
        ["session", "start", "--config", str(config), "--user", "alice", "--template", "pytorch",
         "--until", "30m", "--key", "adhoc-cli"]
    )  # fmt: skip
    output = capsys.readouterr().out
    assert code == 0, output
    assert "session adhoc-cli (running) for alice" in output
    (session,) = site.runtime().list_sessions()
    assert f"ssh -p {session.ssh_port} alice@127.0.0.1" in output
    assert session.ftp_password in output
    assert main(["session", "list", "--config", str(config), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [item["key"] for item in listed] == ["adhoc-cli"]
    assert "ftp_password" not in listed[0]
    assert main(["session", "list", "--config", str(config)]) == 0
    assert "adhoc-cli  alice  running" in capsys.readouterr().out
    assert main(["session", "stop", "--config", str(config), "adhoc-cli", "--grace", "1s"]) == 0
    assert "stopped; output kept" in capsys.readouterr().out
    assert main(["session", "stop", "--config", str(config), "adhoc-cli"]) == 0
    assert "nothing to stop" in capsys.readouterr().out
    code = main(
        ["session", "start", "--config", str(config), "--user", "Alice", "--template", "pytorch"]
    )
    error = capsys.readouterr().err
    assert code == 1 and "not a valid login" in error and "Traceback" not in error


def _toml(site: Site) -> str:
    host = site.config.host()
    return f"""
[daemon]
host = "{TEST_HOST}"
state_dir = "{site.root / "state"}"
[[hosts]]
name = "{TEST_HOST}"
gpus = []
gpu_mode = "none"
bind_address = "127.0.0.1"
ssh_ports = "{host.ssh_ports}"
ftp_ports = "{host.ftp_ports}"
ftp_passive_ports = "{host.ftp_passive_ports}"
ftp_passive_per_session = {host.ftp_passive_per_session}
[templates]
base_image = "{BASE_IMAGE}"
[users]
keys_dir = "{site.root / "keys"}"
host_authorized_keys = false
[storage]
output_root = "{site.root / "output"}"
[limits]
shm_size = "256m"
"""


def test_the_gateway_treats_gone_as_removed_and_names_refusals(
    engine_harness: DockerHarness,
) -> None:
    engine = Engine(engine_harness.client)
    engine.remove_container(f"gpuresa-{TEST_HOST}-never-was")
    engine.remove_network(f"gpuresa-{TEST_HOST}-never-was")
    engine.stop_container(f"gpuresa-{TEST_HOST}-never-was", 1)
    assert engine.inspect(f"gpuresa-{TEST_HOST}-never-was") is None
    assert engine.image_id("gpuresa-test/never-was:1") is None
    with pytest.raises(EngineRefused, match="create container") as caught:
        engine.create_container(
            f"gpuresa-{TEST_HOST}-bad",
            {"Image": "gpuresa-test/never-was:1", "Labels": {"gpuresa.host": TEST_HOST}},
            "key",
        )
    assert caught.value.status == 404
    assert isinstance(caught.value, SessionError)


@pytest.mark.parametrize(
    ("mode", "gpus", "nvidia_smi", "expected"),
    [
        ("nvidia", [0, 2], None, (0, 2)),
        ("nvidia", "auto", "printf '0\\n1\\n3\\n'", (0, 1, 3)),
        ("nvidia", "auto", "exit 9", ()),  # nvidia-smi fails: no GPUs handed out
        ("nvidia", "auto", None, ()),  # no nvidia-smi at all
        ("none", [0, 1], None, ()),
    ],
)
def test_host_gpus_come_from_the_config_or_nvidia_smi(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    gpus: Any,
    nvidia_smi: str | None,
    expected: tuple[int, ...],
) -> None:
    # a PATH of our own: a GPU server's real nvidia-smi must not be found
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("sh", "printf"):
        found = shutil.which(tool)
        assert found is not None
        (tools / tool).symlink_to(found)
    if nvidia_smi is not None:
        (tools / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    config = parse_config(
        {
            "daemon": {"host": TEST_HOST},
            "hosts": [{"name": TEST_HOST, "gpu_mode": mode, "gpus": gpus}],
        },
        "test.toml",
    )
    if nvidia_smi is None and gpus == "auto":
        assert shutil.which("nvidia-smi") is None
    assert Runtime(config).host_gpus() == expected


def test_an_engine_that_does_not_answer_is_reported_as_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-engine.sock'}")
    config = parse_config(
        {"daemon": {"host": TEST_HOST}, "hosts": [{"name": TEST_HOST, "gpu_mode": "none"}]},
        "test.toml",
    )
    runtime = Runtime(config)  # making it needs no engine
    with pytest.raises(RuntimeUnavailable):
        runtime.list_sessions()
    with pytest.raises(RuntimeUnavailable):
        runtime.stop("any", timedelta(0))
