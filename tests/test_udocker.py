"""udocker sessions (engine = "udocker"): real udocker and runc, real host accounts, real sshd.

Each test gets a host account of its own (useradd, removed after) and a site
in a folder every user may traverse (pytest's own is root's alone). The image
is the Docker-built pytorch template, saved and loaded into the account's
udocker repository once per module. Users log in with paramiko.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import paramiko
import pytest
from conftest import BASE_IMAGE, TEST_HOST, run_login
from support.accounts import kill_processes, remove_account
from support.gpu_nodes import stand_in_gpu_nodes
from support.logins import run, ssh_login
from support.waiting import wait_for
from test_runtime import free_block

from gpuresa.access import host_account
from gpuresa.backends.factory import open_backend
from gpuresa.backends.udocker import UdockerBackend, launch
from gpuresa.backends.udocker.records import FINGERPRINT
from gpuresa.config.reading import parse_config
from gpuresa.gpus.cgroups import container_of
from gpuresa.model import Session
from gpuresa.outputs.messages import start_details
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.host_keys import fingerprint_of
from gpuresa.sessions.limits import local_totals, session_limits

# real host accounts, real daemons and servers: not for the fast lane
pytestmark = pytest.mark.services


class Site:
    def __init__(
        self,
        root: Path,
        login: str,
        gpu_mode: str = "none",
        gpus: Any = (),
        limits: dict[str, Any] | None = None,
        spares: bool = False,
        **host: Any,
    ) -> None:
        self.root, self.login = root, login
        for folder in ("keys", "private", "input", "output", "state"):
            (root / folder).mkdir(parents=True, exist_ok=True)
            os.chmod(root / folder, 0o755)
        (root / "input" / "dataset.csv").write_text("x,y\n1,2\n")
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "private" / login)],
            check=True,
        )
        (root / "private" / f"{login}.pub").rename(root / "keys" / f"{login}.pub")
        first = free_block(20)
        table = {
            "name": TEST_HOST,
            "engine": "udocker",
            "gpus": list(gpus),
            "gpu_mode": gpu_mode,
            "bind_address": "127.0.0.1",
            "ssh_ports": f"{first}-{first + 3}",
            "ftp_ports": f"{first + 4}-{first + 7}",
            "ftp_passive_ports": f"{first + 8}-{first + 19}",
            "ftp_passive_per_session": 3,
            "driver_binaries": [],
            **host,
        }
        self.config = parse_config(
            {
                "daemon": {"host": TEST_HOST, "state_dir": str(root / "state")},
                # a key given as None is left to its default
                "hosts": [{key: value for key, value in table.items() if value is not None}],
                "templates": {"base_image": BASE_IMAGE},
                "users": {"keys_dir": str(root / "keys"), "host_authorized_keys": False},
                "storage": {
                    "output_root": str(root / "output"),
                    "inputs": [{"source": str(root / "input"), "target": "/data"}],
                },
                "limits": limits or {"shm_size": "256m", "pids": 256, "memory": "1g"},
                # each test has a login of its own: a spare unpacked beside every test would
                # never be used (test_udocker_spares.py and the end-to-end test make theirs)
                "udocker": {"spare_containers": spares},
            },
            str(root / "config.toml"),
        )

    def backend(self) -> UdockerBackend:
        backend = open_backend(self.config)
        assert isinstance(backend, UdockerBackend)
        return backend

    def host_key(self, session: Session) -> str:
        """The SHA-256 fingerprint of the host key the session's sshd presents."""
        with contextlib.closing(paramiko.Transport(("127.0.0.1", session.ssh_port))) as link:
            link.start_client(timeout=15)
            digest = hashlib.sha256(link.get_remote_server_key().asbytes()).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")

    def run(self, session: Session, command: str) -> tuple[int, str]:
        key = self.root / "private" / self.login
        with ssh_login(session.ssh_port, self.login, key, timeout=15) as client:
            return run(client, command, timeout=60)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (it exists and is no zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(name="login")
def login_fixture() -> Iterator[str]:
    """A host account of this test's own."""
    login = run_login("ud")
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", login], check=True)
    yield login
    remove_account(login)


@pytest.fixture(name="make")
def make_fixture(login: str) -> Iterator[Callable[..., Site]]:
    """Sites of this test's login (each in a folder every user may traverse), removed after."""
    sites: list[Site] = []

    def make(**options: Any) -> Site:
        root = Path(f"/tmp/gpuresa-udocker-{uuid.uuid4().hex[:8]}")
        root.mkdir(mode=0o755)
        sites.append(Site(root, login, **options))
        return sites[-1]

    yield make
    for site in sites:
        backend = site.backend()
        for session in backend.list_sessions():
            backend.kill(session.key)
    # the login's detached work (a spare's maker, a removal) would refill the folders
    kill_processes(login)
    for site in sites:
        shutil.rmtree(site.root, ignore_errors=True)


@pytest.fixture(name="site")
def site_fixture(make: Callable[..., Site]) -> Site:
    return make()


def spec_of(site: Site, backend: UdockerBackend, template: str = "pytorch", **options: Any) -> Any:
    end = datetime.now(UTC) + timedelta(hours=1)
    spec = backend.new_spec(site.login, template, end, **options)
    backend.provision(spec.template, spec.cuda)
    return spec


def test_a_session_runs_as_the_login_with_its_folders(site: Site) -> None:
    backend = site.backend()
    backend.check()
    spec = spec_of(site, backend)
    assert backend.provisioned(spec.template, spec.cuda)
    prepared = backend.prepare(spec)
    assert prepared.state == "created"
    with pytest.raises((paramiko.SSHException, EOFError, OSError)):
        site.run(prepared, "true")
    session = backend.start(spec)
    code, text = site.run(
        session, "id -un; id -u; cat /data/dataset.csv; echo result > /output/result.txt; "
        "touch /data/new || echo read-only; cat /etc/gpuresa/session/banner",
    )  # fmt: skip
    assert code == 0, text
    lines = text.splitlines()
    assert lines[:2] == [site.login, "0"], text
    assert "read-only" in text and "gpuresa session of" in text
    account = subprocess.run(["id", "-u", site.login], capture_output=True, text=True, check=True)
    result = session.output_dir / "result.txt"
    assert result.stat().st_uid == int(account.stdout)
    # a new backend object (a restarted daemon) adopts it from the records and cgroups
    adopted = {item.key: item for item in site.backend().list_sessions()}
    assert adopted[spec.key].state == "running"
    assert adopted[spec.key].ssh_port == spec.ssh_port
    # the GPU tracker tells the session's processes by their cgroup; a host process has none
    _, roles = site.backend().sessions_and_units()

    def owners_seen() -> set[str | None] | None:
        members = backend.cgroup(spec.key).members()
        # a member may exit between the listing and the reading (the login's own sshd child),
        # and wait a moment to be reaped: a zombie is in no cgroup any more
        owners = {(pid, container_of(pid)) for pid in members}
        seen = {owner for pid, owner in owners if owner is not None or alive(pid)}
        return seen if members and seen == set(roles) else None

    # a login's processes still exiting settle within moments; one outside the session never
    assert wait_for(owners_seen, 10, "every member of the session's cgroup to be its own")
    assert roles[str(container_of(backend.cgroup(spec.key).members()[0]))] == (spec.key, "main")
    assert container_of(os.getpid()) is None
    site.backend().extend(spec.key, spec.end + timedelta(hours=1))
    site.backend().message(spec.key, "ten minutes left")
    code, text = site.run(session, "cat /etc/gpuresa/session/message /etc/gpuresa/session/end")
    assert "ten minutes left" in text
    # the start notice names the key the session's sshd presents, as made: the user
    # replacing the public half in their own `ssh` folder changes nothing of it
    presented = site.host_key(session)
    assert f" {presented} " in adopted[spec.key].host_key
    public = next(Path(backend.records.folder(spec.key), "ssh").glob("*.pub"))
    subprocess.run(["runuser", "-u", site.login, "--", "sh", "-c",
                    f"ssh-keygen -q -t ed25519 -N '' -f {public.parent}/other && "
                    f"cat {public.parent}/other.pub > {public}"], check=True)  # fmt: skip
    again = site.backend().session(spec.key)
    assert again is not None and presented in again.host_key
    assert presented in start_details(site.config, again, "127.0.0.1")
    # a session made before fingerprints were kept: taken once from the public half, which
    # the user may have changed (only their own notice says so); never through a link, a
    # hard link or a file not theirs
    uid = int(account.stdout)
    kept = backend.records.folder(spec.key) / FINGERPRINT
    kept.unlink()
    other = Path(public.parent, "other.pub")
    public.unlink()
    public.symlink_to(other)
    assert backend.records.fingerprint(spec.key, uid) == "" and not kept.exists()
    public.unlink()
    os.link(other, public)
    assert backend.records.fingerprint(spec.key, uid) == "" and not kept.exists()
    public.unlink()
    shutil.copy(other, public)  # root's
    assert backend.records.fingerprint(spec.key, uid) == "" and not kept.exists()
    os.chown(public, uid, uid)
    replaced = fingerprint_of(public.read_text())
    assert backend.records.fingerprint(spec.key, uid) == replaced != again.host_key
    assert kept.read_text() == replaced + "\n"
    # the comment, the login's own text, is left out of what the notice shows
    assert "@" not in replaced and replaced.endswith(" (ED25519)"), replaced


def test_stop_ends_what_ignores_sigterm_and_a_fork_bomb(site: Site) -> None:
    backend = site.backend()
    spec = spec_of(site, backend)
    session = backend.start(spec)
    code, text = site.run(
        session,
        "sudo -n nohup sh -c 'trap \"\" TERM; exec sleep 100000' >/dev/null 2>&1 & "
        "setsid sh -c 'trap \"\" TERM; while :; do (sleep 1000 &) ; sleep 0.01; done' "
        ">/dev/null 2>&1 & sleep 1; echo started",
    )
    assert code == 0, text
    cgroup = backend.cgroup(spec.key)
    assert len(cgroup.members()) > 5
    pids_max = (cgroup.folder("pids") / "pids.max").read_text().strip()
    assert pids_max == "256"
    began = time.monotonic()
    backend.stop(spec.key, timedelta(seconds=2))
    took = time.monotonic() - began
    assert 2 <= took < 20, took
    assert not cgroup.exists()
    # nothing of the user's runs but the removal of the container's files (dead processes
    # wait for this machine's init to reap them)
    left = subprocess.run(
        ["ps", "-ww", "-o", "pid=,stat=,args=", "-U", site.login], capture_output=True, text=True
    )
    others = [
        line
        for line in left.stdout.splitlines()
        if " rm -f gpuresa-" not in line and line.split()[1][0] != "Z"
    ]
    assert others == [], left.stdout
    assert spec.key not in {item.key for item in backend.list_sessions()}
    backend.stop(spec.key, timedelta(seconds=1))
    backend.kill(spec.key)


def test_a_login_without_a_host_account_is_refused(site: Site) -> None:
    backend = site.backend()
    spec = backend.new_spec("nobodyhere", "pytorch", datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(SessionError, match="no account on host"):
        backend.check_spec(spec)


# --- a share of the host, and only the booked GPUs ---------------------------------------------


@pytest.fixture(name="stand_in_gpus")
def stand_in_gpus_fixture() -> Iterator[dict[str, int]]:
    """NVIDIA's nodes where none exists: GPU 0 one no driver serves, GPU 1 /dev/null's."""
    with stand_in_gpu_nodes() as numbers:
        yield numbers


def test_a_session_gets_its_gpus_share_of_the_host_and_no_other_gpu(
    make: Callable[..., Site], stand_in_gpus: dict[str, int]
) -> None:
    assert stand_in_gpus["nvidia0"] != stand_in_gpus["nvidia1"], "/dev/nvidia0 is not ours"
    site = make(gpu_mode="devices", gpus=[0, 1], limits={"shm_size": "256m", "pids": 300})
    backend = site.backend()
    session = backend.start(spec_of(site, backend, gpus=(1,)))
    assert session.gpu_indices == (1,)
    code, text = site.run(
        session,
        "test -c /dev/nvidia1 && test -c /dev/nvidiactl && test -c /dev/nvidia-uvm"
        " && ! test -e /dev/nvidia0 && echo devices-ok;"
        " echo x > /dev/nvidia1 && echo writable;"
        " echo visible $NVIDIA_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES",
    )
    assert code == 0, text
    assert "devices-ok" in text and "writable" in text, text
    assert "visible 1 1" in text, text
    # the cgroup: half the host (one of two GPUs), less its reserve, swap included; pids
    expected = session_limits(site.config.limits, local_totals(2), 1)
    cgroup = backend.cgroup(session.key)
    memory = cgroup.folder("memory")
    assert int((memory / "memory.limit_in_bytes").read_text()) == expected.memory
    assert int((memory / "memory.memsw.limit_in_bytes").read_text()) == expected.memory
    cpu = cgroup.folder("cpu")
    quota = int((cpu / "cpu.cfs_quota_us").read_text())
    assert quota == int(expected.cpus * int((cpu / "cpu.cfs_period_us").read_text()))
    assert (cgroup.folder("pids") / "pids.max").read_text().strip() == "300"
    # the devices cgroup alone: a process of the session that finds GPU 0's node (here, the
    # host's, reached outside the container) may not open it; the same user outside may
    account = host_account(site.login)
    assert account is not None
    probe = "echo x > /dev/nvidia0 || echo refused"
    report = site.root / "probe.log"
    launch.spawn(cgroup, account, ["/bin/sh", "-c", probe], {"PATH": "/usr/bin:/bin"}, report)
    outside = subprocess.run(
        ["setpriv", "--reuid", site.login, "--regid", site.login, "--clear-groups",
         "/bin/sh", "-c", probe], capture_output=True, text=True,
    )  # fmt: skip
    wait_for(lambda: "refused" in report.read_text(), 10, "the probe's report")
    assert "Operation not permitted" in report.read_text(), report.read_text()
    assert "No such device" in outside.stderr, outside.stderr


def test_a_session_over_its_memory_is_stopped_inside_its_cgroup(make: Callable[..., Site]) -> None:
    site = make(limits={"shm_size": "64m", "pids": 256, "memory": "300m", "cpus": 1.5})
    backend = site.backend()
    session = backend.start(spec_of(site, backend))
    cgroup = backend.cgroup(session.key)
    assert (cgroup.folder("cpu") / "cpu.cfs_quota_us").read_text().strip() == "150000"
    # tail keeps the last (newline-free) line whole: 600 MiB, past memory and swap
    _, text = site.run(session, "head -c 600M /dev/zero | tail >/dev/null; echo $?")
    assert text.split()[-1] != "0", text
    _, text = site.run(session, "echo still-here")
    assert text.strip() == "still-here", text


def test_bench_runs_both_sides_as_the_login_and_the_container_with_udocker(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuresa.backends.udocker import tools
    from gpuresa.cli import main

    config = site.root / "bench.toml"
    config.write_text(
        f"""
[daemon]
host = "{TEST_HOST}"
state_dir = "{site.root / "state"}"
[[hosts]]
name = "{TEST_HOST}"
engine = "udocker"
gpu_mode = "none"
driver_binaries = []
[templates]
base_image = "{BASE_IMAGE}"
[storage]
output_root = "{site.root / "output"}"
"""
    )
    # a udocker bench runs as a login, never as root
    assert main(["bench", "--config", str(config), "--runs", "1"]) == 1
    assert "--user LOGIN" in capsys.readouterr().err
    assert main(["bench", "--config", str(config), "--runs", "1", "--user", "root"]) == 1
    assert "no host account of a user" in capsys.readouterr().err
    # each side prints the host uid it runs as: the login's on both (the container's root
    # is the login, as in its sessions); only the container has the scripts' folder
    command = (
        "if [ -r /opt/gpuresa-bench/cpu_matmul.py ]; then read -r inside outside count "
        '</proc/self/uid_map; echo "result: $outside uid"; else echo "result: $(id -u) uid"; fi'
    )
    code = main(
        ["bench", "--config", str(config), "--runs", "2", "--user", site.login,
         "--command", command]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    uid = host_account(site.login).uid  # type: ignore[union-attr]
    assert f"CPU: host {uid}.0, container {uid}.0 uid, ratio 1.000" in captured.out, captured.out
    # the container's exit status is its command's (udocker's own is 1 without a terminal)
    failing = "echo 'result: 1 x'; [ -r /opt/gpuresa-bench/cpu_matmul.py ] && exit 3; true"
    arguments = ["--runs", "1", "--user", site.login, "--command", failing]
    assert main(["bench", "--config", str(config), *arguments]) == 1
    assert "failed on the container (exit code 3)" in capsys.readouterr().err
    # the bench's container is gone from the login's repository after
    containers = tools.repository(site.backend().config, site.login) / "containers"
    wait_for(lambda: not any(containers.glob("gpuresa-bench-*")), 30, "the bench's container to go")
