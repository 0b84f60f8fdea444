"""The session protocol's promises (`gpuresa.sessions.protocol`), checked on every backend.

Each test takes `contract`, one backend of a real site in turn (Docker, Podman,
udocker, a Slurm cluster), and speaks only the protocol: what passes here for one
backend must pass for every other. A user's view is checked the way a user has it, an SSH login.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import paramiko
import pytest
from conftest import _harness, run_login
from slurm_site import SlurmSite, slurm_site
from support.accounts import remove_account
from support.waiting import wait_for
from test_runtime import Site, built_fixture, make_site, run, ssh_login  # noqa: F401

from gpuresa.backends.engines import Runtime
from gpuresa.backends.engines.output_service import OutputService
from gpuresa.backends.factory import open_backend
from gpuresa.backends.udocker import UdockerBackend
from gpuresa.config.capabilities import host_capabilities
from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.protocol import SessionBackend


@dataclasses.dataclass
class Contract:
    """A backend under test, and how to make another one as a restarted daemon would."""

    site: Site | SlurmSite
    make: Callable[[], SessionBackend]
    spec: Callable[..., SessionSpec]
    # where the user finds the session's files and output, and how they become root
    session_dir: str = "/etc/gpuresa/session"
    output: str = "/output"
    sudo: str = "sudo -n "
    # pgrep's options that keep to the session's processes (a container sees only its own)
    own: str = ""

    def __post_init__(self) -> None:
        self.backend = self.make()


# every backend the protocol has: the engines through `Runtime`, udocker, Slurm
BACKENDS = ("docker", "podman", "udocker", "slurm")


@pytest.fixture(name="contract", params=BACKENDS)
def contract_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Contract]:
    if request.param == "udocker":
        request.getfixturevalue("built")(request.getfixturevalue("docker_harness"))
        yield from udocker_contract(request.getfixturevalue("docker_client"))
        return
    if request.param == "slurm":
        with slurm_site(tmp_path) as cluster:

            def spec_on_cluster(**options: Any) -> SessionSpec:
                options.pop("user", None)
                return cluster.spec(**options)

            yield Contract(
                cluster,
                cluster.backend,
                spec_on_cluster,
                "$GPURESA_SESSION",
                "$GPURESA_OUTPUT",
                "",
                '-u "$(id -u)" ',
            )
        return
    client = request.getfixturevalue(f"{request.param}_client")
    for engine_harness in _harness(client, request.param, request):
        request.getfixturevalue("built")(engine_harness)
        yield _engine_contract(tmp_path, engine_harness)


def _engine_contract(tmp_path: Path, engine_harness: Any) -> Contract:
    site = make_site(tmp_path, engine_harness.client, engine=engine_harness.engine)

    def make() -> SessionBackend:
        return Runtime(site.config, site.client)

    def spec(**options: Any) -> SessionSpec:
        end = options.pop("end", datetime.now(UTC) + timedelta(hours=1))
        user = options.pop("user", "alice")
        runtime = Runtime(site.config, site.client)
        return runtime.new_spec(user, "pytorch", end, **options)

    return Contract(site, make, spec)


def udocker_contract(docker_client: Any) -> Iterator[Contract]:
    """A udocker site whose login is a host account of this test's own (its sessions run as
    it), with its key in the site's keys, its image provisioned; all removed after."""
    login = run_login("uc")
    root = Path(f"/tmp/gpuresa-contract-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o755)
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", login], check=True)
    try:
        site = make_site(root, docker_client, engine="udocker", driver_binaries=[])
        for folder in ("keys", "input", "output", "state"):
            os.chmod(root / folder, 0o755)
        private = root / "private" / login
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(private)],
                       check=True)  # fmt: skip
        private.with_suffix(".pub").rename(root / "keys" / f"{login}.pub")

        def make() -> SessionBackend:
            return open_backend(site.config)

        def spec(**options: Any) -> SessionSpec:
            end = options.pop("end", datetime.now(UTC) + timedelta(hours=1))
            user = options.pop("user", login)
            backend = open_backend(site.config)
            assert isinstance(backend, UdockerBackend)
            return backend.new_spec(user, "pytorch", end, **options)

        contract = Contract(site, make, spec)
        first = spec()
        contract.backend.provision(first.template, first.cuda)
        yield contract
        for session in contract.make().list_sessions():
            contract.make().kill(session.key)
    finally:
        remove_account(login)
        shutil.rmtree(root, ignore_errors=True)


def test_every_backend_declares_what_its_hosts_entry_says_it_can_do(contract: Contract) -> None:
    config = contract.site.config
    capabilities = contract.backend.capabilities
    # what the planner and the config checks know without opening the backend
    assert capabilities == host_capabilities(config.host())
    # the output service runs only beside a backend that leaves its outputs to it
    service = OutputService(config, contract.backend)
    assert service.enabled == (config.storage.sftp_port != 0 and not capabilities.serves_outputs)
    if capabilities.serves_outputs:
        with pytest.raises(SessionError, match="serve their outputs themselves"):
            service.remove()


def login_user(contract: Contract, session: Session, command: str) -> str:
    with ssh_login(session, session.user, contract.site.key(session.user)) as client:
        code, output = run(client, command)
    assert code == 0, output
    return output


def test_every_backend_speaks_the_protocol(contract: Contract) -> None:
    assert isinstance(contract.backend, SessionBackend)
    contract.backend.check()
    spec = contract.spec()
    assert contract.backend.provisioned(spec.template, spec.cuda)


def test_prepare_keeps_the_user_out_until_start_lets_them_in(contract: Contract) -> None:
    backend, spec = contract.backend, contract.spec()
    prepared = backend.prepare(spec)
    assert (prepared.key, prepared.state) == (spec.key, "created")
    with pytest.raises((paramiko.SSHException, EOFError, OSError)):
        login_user(contract, prepared, "true")
    started = backend.start(spec)
    assert started.state == "running"
    assert login_user(contract, started, "id -un").strip() == spec.user
    # idempotent: a second start returns the running session as it is
    assert backend.start(spec).ssh_port == started.ssh_port


def test_a_new_backend_object_adopts_what_runs(contract: Contract) -> None:
    spec = contract.spec()
    contract.backend.start(spec)
    adopted = {session.key: session for session in contract.make().list_sessions()}
    assert spec.key in adopted
    session = adopted[spec.key]
    assert (session.user, session.ssh_port, session.state) == (spec.user, spec.ssh_port, "running")
    assert session.end == spec.end.replace(microsecond=0) or session.end == spec.end


def test_a_session_is_used_once_its_user_logs_in_and_not_before(contract: Contract) -> None:
    """What no-shows rest on (`used`): a running session nobody logged into is unused, a
    login makes it used; a session that is not there tells nothing."""
    backend, spec = contract.backend, contract.spec()
    assert backend.used(spec.key) is None
    session = backend.start(spec)
    assert backend.used(spec.key) is False
    login_user(contract, session, "true")
    wait_for(lambda: backend.used(spec.key), 10, "the login in the session's log")
    assert contract.make().used(spec.key) is True


def test_extend_and_message_are_shown_in_the_session(contract: Contract) -> None:
    spec = contract.spec()
    session = contract.backend.start(spec)
    later = spec.end + timedelta(hours=2)
    contract.backend.extend(spec.key, later)
    listed = {item.key: item for item in contract.make().list_sessions()}[spec.key]
    assert abs((listed.end - later).total_seconds()) < 1
    contract.backend.message(spec.key, "ten minutes left")
    shown = login_user(contract, session, f"cat {contract.session_dir}/message")
    assert "ten minutes left" in shown
    facts = contract.backend.facts(listed)
    assert (facts.user, abs((facts.end - later).total_seconds()) < 1) == (spec.user, True)


def test_stop_gives_the_grace_then_removes_and_keeps_the_output(contract: Contract) -> None:
    spec = contract.spec()
    session = contract.backend.start(spec)
    # a process that ignores SIGTERM, started through sudo: only the kill after the grace ends it
    login_user(
        contract,
        session,
        f"echo result > {contract.output}/result.txt; "
        f"{contract.sudo}nohup sh -c 'trap \"\" TERM; exec tail -f /dev/null' >/dev/null 2>&1 &",
    )
    assert login_user(contract, session, f"pgrep -c -x {contract.own}tail").strip() == "1"
    began = time.monotonic()
    contract.backend.stop(spec.key, timedelta(seconds=2))
    took = time.monotonic() - began
    assert 2 <= took < 20, took
    assert spec.key not in {item.key for item in contract.make().list_sessions()}
    assert (session.output_dir / "result.txt").read_text() == "result\n"
    # idempotent: stopping or killing what is gone does nothing
    contract.backend.stop(spec.key, timedelta(seconds=1))
    contract.backend.kill(spec.key)


def text_in_session(contract: Contract, session: Session, path: str) -> str | None:
    """The text of file `path` in the session ("" when there is none), read through a login;
    None when the login was cut (a signal sent meanwhile reaches its sshd too, and may reach
    it late: on Slurm the job script passes it on)."""
    try:
        return login_user(contract, session, f"cat {path} 2>/dev/null; true")
    except (paramiko.SSHException, EOFError, OSError):
        return None


def test_signal_reaches_the_users_processes_and_ends_nothing_of_the_session(
    contract: Contract,
) -> None:
    spec = contract.spec()
    session = contract.backend.start(spec)
    # a checkpointing script: it catches SIGUSR1 and says so; the login returns once its trap
    # is set (the output folder: the session's own on every backend)
    ready, signalled = f"{contract.output}/ready.txt", f"{contract.output}/signalled.txt"
    script = f'trap "echo got > {signalled}" USR1; echo > {ready}; while :; do sleep 0.2; done'
    # and a job that does not catch it, which the default action of SIGUSR1 would end
    bystander = f"{contract.output}/bystander.pid"
    login_user(
        contract,
        session,
        f"nohup sh -c '{script}' >/dev/null 2>&1 & nohup sleep 600 >/dev/null 2>&1 & "
        f"echo $! > {bystander}; while [ ! -e {ready} ]; do sleep 0.1; done",
    )
    assert contract.backend.signal(spec.key, signal.SIGUSR1) > 0
    wait_for(
        lambda: text_in_session(contract, session, signalled) == "got\n",
        30,
        "the script to catch SIGUSR1",
        every=0.5,
    )
    # nothing of the session's own went with it: it lists as running and lets its user in
    listed = {item.key: item for item in contract.make().list_sessions()}
    assert listed[spec.key].state == "running"
    assert login_user(contract, session, "echo up").strip() == "up"
    # the warning went only to what catches it: the job without a handler runs on
    alive = login_user(contract, session, f"kill -0 $(cat {bystander}) && echo alive")
    assert alive.strip() == "alive"
    assert contract.backend.signal(f"no-such-{spec.key}", signal.SIGUSR1) == 0


def test_kill_ends_at_once(contract: Contract) -> None:
    spec = contract.spec()
    contract.backend.start(spec)
    began = time.monotonic()
    contract.backend.kill(spec.key)
    assert time.monotonic() - began < 15
    assert spec.key not in {item.key for item in contract.backend.list_sessions()}


def test_a_spec_the_host_cannot_serve_is_refused_before_anything_is_made(
    contract: Contract,
) -> None:
    # more GPUs than any host or node of the tests has
    spec = dataclasses.replace(contract.spec(), gpu_count=97, gpu_indices=tuple(range(97)))
    with pytest.raises(SessionError):
        contract.backend.check_spec(spec)
    with pytest.raises(SessionError):
        contract.backend.start(spec)
    assert spec.key not in {item.key for item in contract.backend.list_sessions()}


def test_cleanup_never_touches_a_busy_session(contract: Contract) -> None:
    spec = contract.spec()
    contract.backend.start(spec)
    removed = contract.backend.cleanup({spec.key})
    assert all(spec.key not in name for name in removed)
    assert login_user(contract, contract.backend.start(spec), "echo up").strip() == "up"
