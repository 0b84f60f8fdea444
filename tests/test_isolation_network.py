"""Host accounts reach no session address: only what gpuresa publishes.

The attack, on both engines: a session's bridge network is routable from the
host, so any host account could read what a session serves on a port it
never published (`python3 -m http.server` with its results, a notebook).
Each session network gets a rule in gpuresa's own chain (see `firewall`):
here a throw-away host account is refused at the container's address while
root (the daemon's checks) still connects and the published ports still
answer it; the control deletes the rule and shows the account then reads the
file, so the test fails if anything else were doing the blocking. The rule
goes with the session, and the cleanup collects the rule of a session whose
containers vanished, never another installation's.
"""

from __future__ import annotations

import functools
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import docker
import pytest
from conftest import run_login
from support.waiting import wait_for
from test_isolation_output import as_user
from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    built_fixture,
    site_fixture,
)

from gpuresa.backends.engines import firewall
from gpuresa.model import Session
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import session_name

HOST_PYTHON = "/usr/bin/python3"
SERVED_PORT = 8000
SECRET = "results of the session"
# a benchmarking range (RFC 2544), routed nowhere: for a rule that closes nothing in use
UNUSED_SUBNET = "198.18.240.0/24"

# what the host account runs: one connection, what it read or why it failed, and how long it took
CONNECT = """
import socket, sys, time
address, port, request = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
began = time.monotonic()
try:
    with socket.create_connection((address, port), timeout=5) as connection:
        connection.settimeout(5)
        connection.sendall(request)
        data = connection.recv(4096)
        # a request is answered until the server closes (HTTP/1.0); a banner is one read
        while request and len(data) < 65536:
            more = connection.recv(4096)
            if not more:
                break
            data += more
    print("read", " ".join(data.decode(errors="replace").split()))
except OSError as error:
    print("failed", type(error).__name__, error)
print("seconds", round(time.monotonic() - began, 3))
"""


@pytest.fixture
def account() -> Iterator[int]:
    """A throw-away host account with a shell (removed afterwards): its uid."""
    login = run_login("gnet")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", login], check=True)
    try:
        yield int(subprocess.run(["id", "-u", login], capture_output=True, text=True).stdout)
    finally:
        subprocess.run(["userdel", login], check=False)


def connect_as(uid: int, address: str, port: int, request: str = "") -> tuple[str, float]:
    """What host uid `uid` gets from one connection: its output line and the seconds it took."""
    result = as_user(uid, HOST_PYTHON, "-c", CONNECT, address, str(port), request)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 2, result
    return lines[0], float(lines[1].split()[1])


def get_file(address: str) -> str:
    return f"GET /results.txt HTTP/1.0\r\nHost: {address}\r\n\r\n"


def chain_rules() -> list[str]:
    """The rules of gpuresa's chain, as `iptables -S` lists them."""
    listing = subprocess.run(
        ["iptables", "-w", "-S", firewall.CHAIN], capture_output=True, text=True, check=False
    ).stdout
    return [line for line in listing.splitlines() if line.startswith("-A ")]


def our_rules(site: Site, session: Session | str) -> list[str]:
    """The lines of the chain that name the session's network."""
    key = session if isinstance(session, str) else session.key
    network = session_name(site.config.daemon.host, key)
    listing = subprocess.run(
        ["iptables", "-w", "-S", firewall.CHAIN], capture_output=True, text=True, check=False
    ).stdout
    return [line for line in listing.splitlines() if f" {network}" in line]


def container_address(site: Site, session: Session) -> str:
    details = site.client.api.inspect_container(session.containers[0])
    network = details["NetworkSettings"]["Networks"][session_name(site.config.daemon.host,
                                                                   session.key)]  # fmt: skip
    return str(network["IPAddress"])


def serve_results(site: Site, session: Session, address: str) -> None:
    """What a user does in the session: serve a results file on an unpublished port."""
    runtime = site.runtime()
    script = (
        f"cd /tmp && echo '{SECRET}' > results.txt && exec python3 -m http.server {SERVED_PORT}"
    )
    runtime.engine.execute_detached(
        session_name(site.config.daemon.host, session.key), ["sh", "-c", script], session.key
    )

    def listens() -> bool:
        try:
            # as root, as the daemon's own checks are: always let through
            with socket.create_connection((address, SERVED_PORT), timeout=2):
                return True
        except OSError:
            return False

    wait_for(listens, 20, f"the server in the session to listen on {address}", every=0.2)


def test_host_accounts_reach_no_session_address_but_what_is_published(
    site: Site, account: int
) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    try:
        [rule] = our_rules(site, session)
        address = container_address(site, session)
        serve_results(site, session, address)

        # the host account is refused, at once, at the container's address
        outcome, seconds = connect_as(account, address, SERVED_PORT, get_file(address))
        assert outcome.startswith("failed ConnectionRefusedError"), outcome
        assert seconds < 1.0, seconds
        # and at sshd's own port there (only the published one is for anyone)
        outcome, _ = connect_as(account, address, 22)
        assert outcome.startswith("failed ConnectionRefusedError"), outcome
        # the published ports answer it as before (Podman DNATs them to that very address)
        outcome, _ = connect_as(account, "127.0.0.1", session.ssh_port)
        assert outcome.startswith("read SSH-2.0-"), outcome
        outcome, _ = connect_as(account, "127.0.0.1", session.ftp_port)
        assert outcome.startswith("read 220"), outcome

        # a second guard of the same network adds nothing (a start retried)
        network = site.client.api.inspect_network(session_name(site.config.daemon.host,
                                                                session.key))  # fmt: skip
        installation = runtime.sessions.installation
        firewall.guard(installation, network["Name"], firewall.network_subnets(network), "test")
        assert our_rules(site, session) == [rule]

        # control: without the rule the account reads the session's file (a rule left by
        # a gone network that had the same subnet, until the cleanup collects it, is set
        # aside too: it would refuse the account just the same)
        subnet = shlex.split(rule)[shlex.split(rule).index("-d") + 1]
        covering = [line for line in chain_rules() if f"-d {subnet} " in line]
        for line in covering:
            subprocess.run(["iptables", "-w", "-D", *shlex.split(line)[1:]], check=True)
        try:
            outcome, _ = connect_as(account, address, SERVED_PORT, get_file(address))
            assert outcome.startswith("read HTTP/1.0 200") and SECRET in outcome, outcome
        finally:
            for line in covering:
                if line != rule:
                    subprocess.run(["iptables", "-w", *shlex.split(line)], check=True)
            firewall.guard(installation, network["Name"], firewall.network_subnets(network), "t")
        assert our_rules(site, session) == [rule]
    finally:
        runtime.stop(session.key, timedelta(seconds=1))
    # the rule went with the session
    assert our_rules(site, session) == []


def test_cleanup_collects_the_rule_of_a_vanished_session_and_no_one_elses(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    other = firewall.guard_rule(UNUSED_SUBNET, "0123456789abcdef", "gpuresa-elsewhere-x")
    stranger = ["-d", UNUSED_SUBNET, "-m", "comment", "--comment", "gpuresa site rule", "-j",
                "RETURN"]  # fmt: skip
    try:
        # another installation's rule, and one gpuresa did not write, in the same chain
        for planted in (other, stranger):
            subprocess.run(["iptables", "-w", "-A", firewall.CHAIN, *planted], check=True)
        [rule] = our_rules(site, session)

        # a running session's rule is never collected
        removed = runtime.collect_garbage(set(), network_min_age=timedelta(0))
        assert rule not in removed and our_rules(site, session) == [rule]

        # its containers removed behind gpuresa's back: its network, then its rule, go
        for container in session.containers:
            gone = functools.partial(removed_behind_the_back, site, container)
            wait_for(gone, 30, f"{container} removed")
        removed = runtime.collect_garbage(set(), network_min_age=timedelta(0))
        assert rule in removed, removed
        assert our_rules(site, session) == []
        for kept in (other, stranger):
            check = ["iptables", "-w", "-C", firewall.CHAIN, *kept]
            assert subprocess.run(check, capture_output=True).returncode == 0, kept
    finally:
        runtime.stop(session.key, timedelta(0))
        for planted in (other, stranger):
            subprocess.run(["iptables", "-w", "-D", firewall.CHAIN, *planted], capture_output=True)
    assert our_rules(site, session) == []


def test_a_network_that_cannot_be_closed_fails_with_the_reason() -> None:
    # the daemon without CAP_NET_ADMIN (a unit that left it out): no session is left open
    script = (
        "from gpuresa.backends.engines import firewall\n"
        "from gpuresa.sessions.errors import SessionError\n"
        "try:\n"
        f"    firewall.guard('0123456789abcdef', 'gpuresa-t-nocap', ['{UNUSED_SUBNET}'], 'k1')\n"
        "except SessionError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    print('guarded')\n"
    )
    result = subprocess.run(
        ["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin", "--",
         sys.executable, "-c", script],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    # were it guarded after all, the rule goes
    firewall.unguard("0123456789abcdef", "gpuresa-t-nocap", "k1")
    assert result.returncode == 0, result.stderr
    assert "session k1: its network cannot be closed to host accounts" in result.stdout
    assert "CAP_NET_ADMIN" in result.stdout
    # and a network with no subnet is refused rather than left open
    with pytest.raises(SessionError, match="no subnet"):
        firewall.guard("0123456789abcdef", "gpuresa-t-empty", [], "k2")


@pytest.mark.parametrize(
    ("listing", "networks", "stale"),
    [
        # a live network's rule stays; a gone one's goes
        (['-A GPURESA-SESSIONS -d 10.89.4.0/24 -m comment --comment "gpuresa me net-a" -j REJECT',
          '-A GPURESA-SESSIONS -d 10.89.5.0/24 -m comment --comment "gpuresa me net-b" -j REJECT'],
         {("net-a", "10.89.4.0/24")}, [1]),
        # the same name on another subnet (made again): the old subnet's rule goes
        (['-A GPURESA-SESSIONS -d 10.89.4.0/24 -m comment --comment "gpuresa me net-a" -j REJECT'],
         {("net-a", "10.89.9.0/24")}, [0]),
        # another installation's rule, a site's own rule, the jump: never
        (['-A GPURESA-SESSIONS -d 10.89.4.0/24 -m comment --comment "gpuresa you net-a" -j REJECT',
          '-A GPURESA-SESSIONS -d 10.89.4.0/24 -m comment --comment "site rule" -j RETURN',
          "-A GPURESA-SESSIONS -d 10.89.4.0/24 -j REJECT",
          "-N GPURESA-SESSIONS", "-A OUTPUT -j GPURESA-SESSIONS", '-A GPURESA "unbalanced'],
         set(), []),
    ],
)  # fmt: skip
def test_only_this_installations_rules_of_gone_networks_are_collected(
    listing: list[str], networks: set[tuple[str, str]], stale: list[int]
) -> None:
    found = firewall.rules_to_collect("\n".join(listing), "me", networks)
    assert found == [listing[index] for index in stale]


def test_the_rule_lets_through_root_published_traffic_and_replies() -> None:
    rule = firewall.guard_rule("192.168.160.0/20", "me", "gpuresa-h-k")
    text = " ".join(rule)
    assert "-m owner ! --uid-owner 0" in text
    assert "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT" in text
    assert firewall.rule_owner(f"-A {firewall.CHAIN} {shlex.join(rule)}") == (
        "me", "gpuresa-h-k", "192.168.160.0/20"
    )  # fmt: skip
    assert firewall.tool_for("fd00:1::/64") == "ip6tables"


def removed_behind_the_back(site: Site, container: str) -> bool:
    """Force-remove `container` as an admin would; False while the engine refuses for now
    (Podman under load: "unlinkat …/userdata/shm: device or resource busy" while the
    container's processes die)."""
    try:
        site.client.api.remove_container(container, force=True)
    except docker.errors.NotFound:
        return True
    except docker.errors.APIError:
        return False
    return True
