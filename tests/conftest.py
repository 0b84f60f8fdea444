"""Real services for the tests: Radicale (CalDAV), Docker and Podman engines, an SMTP server.

A service that cannot start makes the test fail loudly; nothing here skips.
Everything a test makes in Docker carries the run's label (or this run's host
name) and is removed at the end; when a test fails, the logs and `inspect` of
the containers it made are printed.
"""

from __future__ import annotations

import contextlib
import email
import email.message
import email.policy
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from gpuresa.backends.engines import firewall

BASE_IMAGE = "gpuresa/base:bookworm"
# A run's workers (pytest-xdist) inherit its prefix: the run's check of the machine tells
# what any of its workers made from what another run made (`support.machine`).
RUN_PREFIX = os.environ.setdefault("GPURESA_TEST_RUN", uuid.uuid4().hex[:6])
RUN_ID = RUN_PREFIX + uuid.uuid4().hex[:4]
# Sessions made by tests run for this host name, so their gpuresa.host label
# tells them apart from anything else on the engine.
TEST_HOST = f"test-{RUN_ID}"
RUN_LABEL = "gpuresa.test-run"


def run_login(kind: str) -> str:
    """A name for a host account or group a test makes: `kind` (a few letters), this run's
    prefix, six hex digits; the run's check of the machine finds those left by the prefix."""
    return f"{kind}{RUN_PREFIX}{secrets.token_hex(3)}"


PODMAN_SOCKET = "unix:///run/podman/podman.sock"
# The engines sessions run on; tests of what an engine does take `engine_harness`
# and run once on each, the rest use Docker alone.
ENGINES = ("docker", "podman")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(autouse=True)
def _ports_given_back() -> Iterator[None]:
    """The ports a test reserved (`support.configs.free_ports`) are free for others after
    it, and after everything it started has gone (this is torn down last)."""
    yield
    from support.configs import release_ports

    release_ports()


def wait_for_port(port: int, timeout: float, what: str, process: Any = None) -> None:
    """Wait until 127.0.0.1:port accepts a connection; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what} exited with code {process.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    pytest.fail(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


# --- the fast lane ---------------------------------------------------------------

# Fixtures that start or reach a service: a test that uses one (directly or through
# another fixture) is marked `services`, so `pytest -m "not services"` runs the rest.
SERVICE_FIXTURES = frozenset(
    {
        "docker_client",
        "podman_client",
        "docker_harness",
        "podman_harness",
        # asks for an engine's client by name (`getfixturevalue`)
        "engine_harness",
        "radicale",
        "radicale_private",
        "smtp_server",
        # a backend of the shared contract suite, a Slurm cluster, a GRR database
        "contract",
        "cluster",
        "grr_database",
    }
)


# Tests that share one thing of the machine run one after another on the same worker when
# the suite runs in parallel (`make test`: pytest-xdist, `-n 3 --dist loadgroup`): the one
# Slurm cluster (a booking reserves its whole node), the privileged ports of the default
# ranges (picked free, then published: two pickers could meet), and udocker (unpacking an
# image takes both cores). Matched on the test's id.
SHARED = (
    ("slurm", ("test_slurm", "[slurm]")),
    (
        "privileged-ports",
        ("test_host_certificates.py", "test_host_certificate_ports.py", "test_demo_walkthrough.py"),
    ),
    ("udocker", ("test_udocker", "[udocker]")),
    # the tests that kill the rootful Podman API service (and start it again as setup does)
    ("podman-service", ("test_forwarding.py::test_a_session_works_on_ports",)),
    # the runs inside a run that check for leftovers: one's deliberate leak is not the other's
    ("leftover-checks", ("test_host_holds.py::test_a_run_that_",)),
)


def shared_group(nodeid: str) -> str | None:
    """The group of the test `nodeid`, or None when it shares nothing."""
    return next((name for name, parts in SHARED if any(part in nodeid for part in parts)), None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` by `shared_group`: pytest-xdist's own reads `xdist_group` marks
    through a test id it rewrites, which pytest 9 no longer lets it rewrite."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class SharedScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return shared_group(nodeid) or nodeid

    return SharedScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses an engine, a server or the daemon `services`."""
    for item in items:
        uses = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses or item.get_closest_marker("docker") is not None:
            item.add_marker(pytest.mark.services)


# --- the machine before and after -----------------------------------------------

# how long the end of a run waits for what engines remove in the background (Podman's
# network namespaces, a conmon's clean-up) before it counts what is left
LEFTOVERS_SETTLE = 15.0


def _machine_now(session: pytest.Session) -> Any:
    from support.machine import machine_of_run

    base = getattr(session.config, "_tmp_path_factory").getbasetemp()  # noqa: B009
    return machine_of_run(base, RUN_PREFIX, PODMAN_SOCKET)


def _controls_the_run(session: pytest.Session) -> bool:
    """The process that sees the whole run: the only one, or pytest-xdist's controller."""
    return not hasattr(session.config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Record what the machine holds before any test (see `support.machine`)."""
    if _controls_the_run(session):
        session.config.stash[_MACHINE_BEFORE] = _machine_now(session)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run when it left a mount, a loop device, a network namespace, a container
    or a network behind; each is listed."""
    before = session.config.stash.get(_MACHINE_BEFORE, None)
    if before is None:
        return
    deadline = time.monotonic() + LEFTOVERS_SETTLE
    left = _machine_now(session).new_since(before)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = _machine_now(session).new_since(before)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["the run left these behind on the machine:", *(f"  {item}" for item in left)]
    if reporter is not None:
        reporter.write_sep("=", "machine left changed", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines), file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_MACHINE_BEFORE = pytest.StashKey[Any]()


# --- failure reports -------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome: Any = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def _failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "report_call", None)
    return bool(report is not None and report.failed)


# --- Radicale -----------------------------------------------------------------------


@dataclass
class RadicaleServer:
    """A running Radicale server with one user."""

    url: str
    username: str
    password: str
    password_file: Path
    storage: Path
    process: subprocess.Popen[bytes] | None = None
    config_file: Path | None = None
    port: int = 0
    log_file: Path | None = None

    def client(self) -> Any:
        from caldav.davclient import DAVClient

        return DAVClient(url=self.url, username=self.username, password=self.password)

    def new_calendar(self, name: str | None = None) -> Any:
        """A fresh, empty calendar collection; returns the caldav Calendar."""
        principal = self.client().principal()
        return principal.make_calendar(
            name=name or f"cal-{uuid.uuid4().hex[:8]}", cal_id=uuid.uuid4().hex
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def start(self) -> None:
        """(Re)start the server on the same port and storage."""
        assert self.config_file is not None and self.log_file is not None
        self.stop()
        log = self.log_file.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "radicale", "--config", str(self.config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port, 20, "Radicale", self.process)


def start_radicale(directory: Path) -> RadicaleServer:
    """Start Radicale with htpasswd (plain) authentication in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    username, password = "gpuresa", secrets.token_urlsafe(12)
    users = directory / "users"
    users.write_text(f"{username}:{password}\n")
    password_file = directory / "password"
    password_file.write_text(password + "\n")
    port = free_port()
    storage = directory / "collections"
    config_file = directory / "config"
    config_file.write_text(
        f"""
[server]
hosts = 127.0.0.1:{port}
[auth]
type = htpasswd
htpasswd_filename = {users}
htpasswd_encryption = plain
[storage]
filesystem_folder = {storage}
[logging]
level = warning
"""
    )
    server = RadicaleServer(
        url=f"http://127.0.0.1:{port}/",
        username=username,
        password=password,
        password_file=password_file,
        storage=storage,
        config_file=config_file,
        port=port,
        log_file=directory / "radicale.log",
    )
    server.start()
    return server


@pytest.fixture(scope="session")
def radicale(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RadicaleServer]:
    """A real Radicale server for the whole run (tests make their own calendars)."""
    server = start_radicale(tmp_path_factory.mktemp("radicale"))
    yield server
    server.stop()


@pytest.fixture
def radicale_private(tmp_path: Path) -> Iterator[RadicaleServer]:
    """A Radicale server of the test's own, which the test may stop and restart."""
    server = start_radicale(tmp_path / "radicale")
    yield server
    server.stop()


# --- Docker ---------------------------------------------------------------------------


@dataclass
class DockerHarness:
    """The real Docker engine, with what a test made tracked for clean-up."""

    client: Any
    run_label: dict[str, str] = field(default_factory=lambda: {RUN_LABEL: RUN_ID})
    host_name: str = TEST_HOST
    engine: str = "docker"

    @property
    def socket(self) -> str | None:
        """The engine's socket for a gpuresa config (None: Docker's from the environment)."""
        return PODMAN_SOCKET if self.engine == "podman" else None

    def run(self, image: str = BASE_IMAGE, command: Any = None, **options: Any) -> Any:
        """`docker run -d` with the run's label; removed at the end of the test."""
        labels = {**options.pop("labels", {}), **self.run_label}
        return self.client.containers.run(image, command, detach=True, labels=labels, **options)

    def ours(self) -> list[Any]:
        """Containers made by this run, directly or through gpuresa for TEST_HOST."""
        for _ in range(20):
            try:
                return self._ours()
            except docker.errors.NotFound:
                # one was removed between the listing and its inspection; list again
                time.sleep(0.05)
        return self._ours()

    def sessions(self) -> list[Any]:
        """`ours()` but the host's output service, which outlives every session."""
        return [
            container
            for container in self.ours()
            if container.labels.get("gpuresa.role") != "outputs"
        ]

    def _ours(self) -> list[Any]:
        found = {}
        for filters in (
            {"label": f"{RUN_LABEL}={RUN_ID}"},
            {"label": f"gpuresa.host={self.host_name}"},
        ):
            for container in self.client.containers.list(all=True, filters=filters):
                found[container.id] = container
        return list(found.values())

    def remove_all(self) -> None:
        for container in self.ours():
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                container.remove(force=True)
        removed = set()
        for filters in (
            {"label": f"{RUN_LABEL}={RUN_ID}"},
            {"label": f"gpuresa.host={self.host_name}"},
        ):
            for network in self.client.networks.list(filters=filters):
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    network.remove()
                    removed.add(network.name)
        # the session firewall's rules of the networks removed here, behind gpuresa's back
        if removed:
            firewall.remove_rules(lambda owner: owner[1] in removed, "test clean-up")

    def dump(self) -> None:
        """Print logs and inspect output of this run's containers (for a failed test)."""
        for container in self.ours():
            print(f"\n===== container {container.name} ({container.short_id}) =====")
            with contextlib.suppress(docker.errors.APIError):
                print(container.logs(tail=200).decode(errors="replace"))
            print(json.dumps(container.attrs.get("State", {}), indent=2))
            print(json.dumps(container.attrs.get("HostConfig", {}), indent=2)[:4000])


def _engine_client(engine: str) -> Any:
    """A client of the real `engine`; fails the run (never skips) when it does not answer."""
    try:
        if engine == "podman":
            client = docker.DockerClient(base_url=PODMAN_SOCKET, timeout=120)
        else:
            client = docker.from_env(timeout=120)
        client.ping()
    except Exception as error:  # any failure to reach the engine is fatal here
        pytest.fail(f"no {engine} engine answers ({error}); run `make setup` first")
    try:
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"the base image {BASE_IMAGE} is missing in {engine}; run `make setup` first")
    return client


def _wait_for_daemon_jobs(timeout: float = 60) -> None:
    """Wait for the background jobs of daemons the tests ran in this process.

    A job still under way after its daemon's shutdown (the outputs duty making
    the output service's container) would make its container after the last
    clean-up, and leave it behind.
    """
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name in ("gpuresa-outputs", "gpuresa-maintenance", "gpuresa-build"):
            thread.join(max(deadline - time.monotonic(), 0))


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A client of the real Docker engine."""
    client = _engine_client("docker")
    yield client
    _wait_for_daemon_jobs()
    DockerHarness(client).remove_all()
    client.close()


@pytest.fixture(scope="session")
def podman_client() -> Iterator[Any]:
    """A client of the real Podman service, through its Docker-compatible API."""
    client = _engine_client("podman")
    yield client
    _wait_for_daemon_jobs()
    DockerHarness(client, engine="podman").remove_all()
    client.close()


def _harness(client: Any, engine: str, request: pytest.FixtureRequest) -> Iterator[DockerHarness]:
    harness = DockerHarness(client, engine=engine)
    yield harness
    if _failed(request):
        harness.dump()
    harness.remove_all()


@pytest.fixture
def docker_harness(docker_client: Any, request: pytest.FixtureRequest) -> Iterator[DockerHarness]:
    """The Docker engine for one test; dumps logs on failure and removes what the test made."""
    yield from _harness(docker_client, "docker", request)


@pytest.fixture
def podman_harness(podman_client: Any, request: pytest.FixtureRequest) -> Iterator[DockerHarness]:
    """The Podman service for one test, as `docker_harness`."""
    yield from _harness(podman_client, "podman", request)


@pytest.fixture(params=ENGINES)
def engine_harness(request: pytest.FixtureRequest) -> Iterator[DockerHarness]:
    """Each engine in turn, for the tests of what the engines must do alike."""
    client = request.getfixturevalue(f"{request.param}_client")
    yield from _harness(client, request.param, request)


# --- SMTP --------------------------------------------------------------------------------


@dataclass
class SMTPServer:
    """A real SMTP server (aiosmtpd) that keeps every message it receives."""

    host: str
    port: int
    messages: list[email.message.EmailMessage] = field(default_factory=list)
    envelopes: list[tuple[str, list[str]]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, count: int, timeout: float = 20) -> list[email.message.EmailMessage]:
        """Wait until at least `count` messages arrived; fail the test otherwise."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.messages) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    subjects = [message["Subject"] for message in self.messages]
                    pytest.fail(f"expected {count} e-mails within {timeout} s, got {subjects}")
                self.arrived.wait(remaining)
            return list(self.messages)


class _CollectingHandler:
    def __init__(self, server: SMTPServer) -> None:
        self.server = server

    async def handle_DATA(self, smtp: Any, session: Any, envelope: Any) -> str:
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        assert isinstance(message, email.message.EmailMessage)
        with self.server.arrived:
            self.server.messages.append(message)
            self.server.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos)))
            self.server.arrived.notify_all()
        return "250 OK"


@pytest.fixture
def smtp_server() -> Iterator[SMTPServer]:
    """A real SMTP server on a free port of 127.0.0.1."""
    from aiosmtpd.controller import Controller

    # its conversation, logged at INFO, is noise in every failure report
    logging.getLogger("mail.log").setLevel(logging.WARNING)
    server = SMTPServer(host="127.0.0.1", port=free_port())
    controller = Controller(_CollectingHandler(server), hostname=server.host, port=server.port)
    controller.start()
    try:
        yield server
    finally:
        controller.stop()


@pytest.fixture(autouse=True)
def _no_inherited_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never read the machine's own config or credentials by accident."""
    monkeypatch.delenv("GPURESA_CONFIG", raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    os.environ.setdefault("TZ", "UTC")


@pytest.fixture(autouse=True)
def _running_areas_unmounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Sessions mount a running area in each state folder (`outputs.running_area`), which a test
    that starts sessions without a daemon leaves, and a daemon killed while it copied an output
    out of its image leaves that image's reader mount (the next start would take it down),
    and the users' homes it had mounted: unmount the test's after it."""
    from gpuresa.outputs.running_area import RUNNING_FOLDER, STORE_FOLDER

    yield
    base = str(tmp_path_factory.getbasetemp())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        reader = f"/{STORE_FOLDER}/." in point and point.endswith(".copy")
        # a home's mount and its sessions' views, which a killed daemon's next start (or
        # clean-up) takes down (`homes.store`)
        home = "/homes/views/" in point or "/homes/mounted/" in point
        if point.startswith(base) and (point.endswith(f"/{RUNNING_FOLDER}") or reader or home):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@pytest.fixture
def grr_database(tmp_path: Path) -> Iterator[Any]:
    """A fresh GRR database (GRR's tables, a read-only account) on `make setup`'s MariaDB."""
    from grr_database import GRRDatabase

    database = GRRDatabase.create(tmp_path)
    try:
        yield database
    finally:
        database.drop()
