"""Port forwarding that a dead Podman service left behind is removed before a port is reused.

Netavark's rules for a published port (`runtime.forwarding`): a jump in
NETAVARK-HOSTPORT-DNAT commented with the container's id, and a DNAT in its
network's NETAVARK-DN-* chain. A Podman service killed during a removal can
leave them, and the next session on that port then does not answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import docker
import pytest
from conftest import PODMAN_SOCKET, DockerHarness
from test_runtime import built_fixture, make_site, run, ssh_login  # noqa: F401  (`built`)

from gpuresa.backends.engines.forwarding import stale_rules

GONE = "a" * 64
LIVE = "b" * 64
LISTING = f"""-N NETAVARK-DN-1D8721804F16F
-N NETAVARK-DN-22222222
-N NETAVARK-HOSTPORT-DNAT
-A OUTPUT -m addrtype --dst-type LOCAL -j NETAVARK-HOSTPORT-DNAT
-A NETAVARK-DN-1D8721804F16F -s 10.88.0.0/16 -d 127.0.0.1/32 -p tcp -m tcp --dport 38765 -j NETAVARK-HOSTPORT-SETMARK
-A NETAVARK-DN-1D8721804F16F -d 127.0.0.1/32 -p tcp -m tcp --dport 38765 -j DNAT --to-destination 10.88.0.5:22
-A NETAVARK-DN-1D8721804F16F -d 127.0.0.1/32 -p tcp -m tcp --dport 40000:40002 -j DNAT --to-destination 10.88.0.5:40000-40002/40000
-A NETAVARK-DN-22222222 -d 127.0.0.1/32 -p tcp -m tcp --dport 38766 -j DNAT --to-destination 10.89.0.5:22
-A NETAVARK-HOSTPORT-DNAT -p tcp -m tcp --dport 38765 -m comment --comment "dnat name: podman id: {GONE}" -j NETAVARK-DN-1D8721804F16F
-A NETAVARK-HOSTPORT-DNAT -p tcp -m tcp --dport 40000:40002 -m comment --comment "dnat name: podman id: {GONE}" -j NETAVARK-DN-1D8721804F16F
-A NETAVARK-HOSTPORT-DNAT -p tcp -m tcp --dport 38766 -m comment --comment "dnat name: podman id: {LIVE}" -j NETAVARK-DN-22222222
"""  # noqa: E501


@pytest.mark.parametrize(
    ("ports", "live", "expected"),
    [
        # a gone container's jump and DNAT for a port about to be published
        ([38765], {LIVE}, ["--dport 38765 -m comment", "--dport 38765 -j NETAVARK-HOSTPORT-SET",
                           "--dport 38765 -j DNAT"]),
        # a port inside a gone container's range
        ([40001], {LIVE}, ["--dport 40000:40002 -m comment", "--dport 40000:40002 -j DNAT"]),
        # a live container's rules, and other ports' rules, stay
        ([38766], {LIVE}, []),
        ([38765], {LIVE, GONE}, []),
        ([12345], set(), []),
    ],
)  # fmt: skip
def test_only_a_gone_containers_rules_for_the_ports_are_stale(
    ports: list[int], live: set[str], expected: list[str]
) -> None:
    found = [rule.text for rule in stale_rules(LISTING, ports, live)]
    assert len(found) == len(expected)
    for part in expected:
        assert sum(part in text for text in found) == 1, (part, found)


def test_rules_of_a_hostile_listing_are_never_read_as_jumps() -> None:
    # a comment that names an id but is not netavark's jump, or a malformed line
    listing = (
        f'-A INPUT -p tcp --dport 22 -m comment --comment "dnat name: x id: {GONE}" -j ACCEPT\n'
        "-A NETAVARK-HOSTPORT-DNAT garbage\n"
        f'-A NETAVARK-HOSTPORT-DNAT -p tcp --dport 22 -m comment --comment "x id: {GONE}" -j X\n'
    )
    assert stale_rules(listing, [22], set()) == []


def nat_rules(*words: str) -> list[str]:
    listing = subprocess.run(["iptables", "-w", "-t", "nat", "-S"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return [line for line in listing.splitlines() if all(word in line for word in words)]


def service_command() -> list[str]:
    """The command line of the rootful Podman API service that `make setup` started."""
    found = subprocess.run(["pgrep", "-f", "podman.* system service"], capture_output=True,
                           text=True).stdout.split()  # fmt: skip
    pids = [int(pid) for pid in found if pid.isdigit()]
    assert pids, "no Podman API service runs: run `make setup`"
    return Path(f"/proc/{pids[0]}/cmdline").read_bytes().decode().split("\0")[:-1]


def podman_answers(socket: str = PODMAN_SOCKET) -> bool:
    with contextlib.suppress(Exception):
        docker.DockerClient(base_url=socket, timeout=5).ping()
        return True
    return False


@dataclass
class PodmanService:
    """A rootful Podman API service of the test's own, on a socket of its own, over the
    machine's Podman storage: killing it leaves the service other tests use alone."""

    command: list[str]
    socket: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it from / (as scripts/setup.sh starts the shared one) and wait for it."""
        quiet = subprocess.DEVNULL
        self.process = subprocess.Popen(
            ["env", "-C", "/", *self.command],
            stdout=quiet,
            stderr=quiet,
            stdin=quiet,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not podman_answers(self.socket):
            assert time.monotonic() < deadline, "the test's Podman service did not answer"
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    restart = start


@pytest.fixture
def podman_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanService]:
    """A Podman API service of the test's own (the shared one's options, another socket)."""
    socket = f"unix://{tmp_path_factory.mktemp('podman') / 'podman.sock'}"
    shared = service_command()
    url = next(word for word in shared if word.startswith("unix://"))
    service = PodmanService([socket if word == url else word for word in shared], socket)
    service.start()
    yield service
    if service.process is not None and service.process.poll() is None:
        service.kill()


def test_a_session_works_on_ports_a_killed_podman_service_left_forwarded(
    tmp_path: Path,
    podman_harness: DockerHarness,
    built: Callable[[DockerHarness], None],
    podman_service: PodmanService,
    caplog: pytest.LogCaptureFixture,
) -> None:
    built(podman_harness)
    site = make_site(
        tmp_path, podman_harness.client, engine="podman", engine_socket=podman_service.socket
    )
    runtime = site.runtime()
    first = runtime.start(site.spec(runtime))
    ids = [podman_harness.client.containers.get(name).id for name in first.containers]
    written = [rule for container in ids for rule in nat_rules(f"id: {container}")]
    chains = {rule.split()[-1] for rule in written}
    ports = (first.ssh_port, first.ftp_port)
    for chain in chains:
        written += [
            rule
            for rule in nat_rules(f"-A {chain} ", "--dport")
            if any(f"--dport {port} " in rule for port in ports)
        ]
    assert written, "netavark wrote no forwarding for the session"

    # the service dies in the middle of the session's removal
    def remove() -> None:
        with contextlib.suppress(Exception):  # the service is killed under it
            runtime.kill(first.key)

    removal = threading.Thread(target=remove)
    removal.start()
    time.sleep(0.2)
    podman_service.kill()
    removal.join()
    podman_service.restart()
    # the daemon's next round finishes the removal
    runtime.kill(first.key)
    assert not any(podman_harness.client.containers.list(all=True, filters={
        "label": f"gpuresa.reservation={first.key}"}))  # fmt: skip
    # what the dying service left: its own rules for the gone containers (a service that
    # still tore them down before dying is given them back, as written, to leave that state)
    for chain in chains:
        subprocess.run(["iptables", "-w", "-t", "nat", "-N", chain], capture_output=True)
    for rule in written:
        if not nat_rules(rule):
            subprocess.run(["iptables", "-w", "-t", "nat", *split(rule)], check=True)
    assert all(nat_rules(rule) for rule in written)

    try:
        caplog.set_level(logging.WARNING, logger="gpuresa.backends.engines.forwarding")
        spec = site.spec(runtime)
        assert (spec.ssh_port, spec.ftp_port) == (first.ssh_port, first.ftp_port)
        second = runtime.start(spec)
        with ssh_login(second, "alice", site.key("alice")) as client:
            assert run(client, "true")[0] == 0
        assert not any(nat_rules(f"id: {container}") for container in ids)
        told = [record for record in caplog.records if "gone Podman container" in record.message]
        assert told and all(first.key not in record.message for record in told)
        runtime.stop(second.key, timedelta(0))
    finally:
        for rule in written:
            if nat_rules(rule):
                subprocess.run(["iptables", "-w", "-t", "nat", "-D", *split(rule)[1:]])
        for chain in chains:
            if not nat_rules(f"-A {chain} ") and not nat_rules(f"-j {chain}"):
                subprocess.run(["iptables", "-w", "-t", "nat", "-X", chain], capture_output=True)


def split(rule: str) -> list[str]:
    return shlex.split(rule)
