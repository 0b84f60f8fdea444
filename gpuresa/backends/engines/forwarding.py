"""Port forwarding an engine left behind: found and removed before a port is published again.

Podman publishes a port through netavark's netfilter rules: a jump in the nat
chain NETAVARK-HOSTPORT-DNAT, commented with its network's name and the container's id, to the
network's NETAVARK-DN-* chain, whose DNAT rule sends the port to the
container's address. A Podman service that dies while it removes a container
leaves those rules; the next session published on that port gets a listening
socket but its traffic still goes to the gone container's address, and the
session "does not answer". Before a session's ports are published, the rules
that would send one of them to a container the engine no longer has are
removed here, and each is logged once.

Every iptables command of gpuresa goes through `netfilter` here (the
sessions' firewall, `firewall`, too). It uses the `iptables` (and, for an
IPv6 bind address, `ip6tables`) on the PATH: the same tools, and so the same
netfilter backend (nf_tables or legacy), that netavark's iptables driver runs.
Docker needs none of this: dockerd rebuilds its own chains when it starts
again. The daemon needs CAP_NET_ADMIN (and netlink sockets) for it; without
them it logs once and publishes as before.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

JUMP_CHAIN = "NETAVARK-HOSTPORT-DNAT"
# a jump for one port (or a range) of one container to its network's chain
_JUMP = re.compile(
    r"^-A NETAVARK-HOSTPORT-DNAT .*--dport (?P<ports>\d+(?::\d+)?) .*"
    r'--comment "dnat name: \S+ id: (?P<id>[0-9a-f]{64})" '
    r"-j (?P<chain>NETAVARK-DN-[0-9A-Za-z]+)\s*$"
)
_PORTS = re.compile(r"--dport (\d+(?::\d+)?)")
TIMEOUT = 10
# the tools whose failure was already logged (missing, not permitted)
_told: set[str] = set()
_told_lock = threading.Lock()


@dataclass(frozen=True)
class Rule:
    """One rule of the nat table, as `iptables -S` writes it (`-A CHAIN ...`)."""

    text: str

    @property
    def chain(self) -> str:
        return self.text.split()[1]

    @property
    def ports(self) -> range:
        match = _PORTS.search(self.text)
        if match is None:
            return range(0)
        first, _, last = match.group(1).partition(":")
        return range(int(first), int(last or first) + 1)


def stale_rules(listing: str, ports: Collection[int], live: Collection[str]) -> list[Rule]:
    """The rules of `listing` (`iptables -t nat -S`) sending one of `ports` to a gone container.

    A jump whose container id is not in `live` (the engine's containers), and,
    in the chain it jumps to, the rules for the same ports that no remaining
    jump reaches (the DNAT to the gone address). Pure.
    """
    rules = [Rule(line.strip()) for line in listing.splitlines() if line.startswith("-A ")]
    wanted = set(ports)
    stale_jumps: list[tuple[Rule, str]] = []
    kept_jumps: list[tuple[Rule, str]] = []
    for rule in rules:
        match = _JUMP.match(rule.text)
        if match is None:
            continue
        gone = match.group("id") not in live and wanted.intersection(rule.ports)
        (stale_jumps if gone else kept_jumps).append((rule, match.group("chain")))
    stale = [rule for rule, _ in stale_jumps]
    for jump, chain in stale_jumps:
        reached = [kept for kept, target in kept_jumps if target == chain]
        for rule in rules:
            if rule.chain != chain or rule.ports != jump.ports or rule in stale:
                continue
            if not any(set(kept.ports) & set(rule.ports) for kept in reached):
                stale.append(rule)
    return stale


def remove_stale_forwarding(
    ports: Iterable[int], live: Callable[[], Collection[str]], ipv6: bool, key: str
) -> list[str]:
    """Remove the netavark rules that would send one of `ports` to a gone container.

    `live` gives the ids of every container the engine has; it is asked after
    the rules are read, so a container made meanwhile is never taken for a
    gone one. Returns the rules removed; logs, never raises (a host where the
    rules cannot be read or changed keeps them, as before).
    """
    ports = list(ports)
    removed: list[str] = []
    for tool in ("iptables", "ip6tables") if ipv6 else ("iptables",):
        listing = _run(tool, ["-t", "nat", "-S"], key)
        if listing is None or JUMP_CHAIN not in listing:
            continue
        for rule in stale_rules(listing, ports, set(live())):
            arguments = shlex.split(rule.text)
            if _run(tool, ["-t", "nat", "-D", *arguments[1:]], key) is None:
                continue
            log.warning(
                "%s: removed the port forwarding of a gone Podman container (%s -t nat %s), "
                "which would have sent this session's port elsewhere",
                key, tool, rule.text,
            )  # fmt: skip
            removed.append(rule.text)
    return removed


def netfilter(tool: str, arguments: Sequence[str]) -> tuple[bool, str]:
    """Run `tool arguments` (`iptables` or `ip6tables`, waiting for the xtables lock).

    Returns (True, its output) or (False, why it failed: not there, not
    permitted, a rule that does not exist...). Never raises.
    """
    try:
        result = subprocess.run(
            [tool, "-w", str(TIMEOUT), *arguments],
            capture_output=True,
            text=True,
            timeout=TIMEOUT + 5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"cannot run {tool}: {error}"
    if result.returncode != 0:
        return False, result.stderr.strip() or f"{tool}: exit status {result.returncode}"
    return True, result.stdout


def _run(tool: str, arguments: list[str], key: str) -> str | None:
    """`tool arguments` (waiting for the xtables lock); its output, or None when it failed."""
    done, output = netfilter(tool, arguments)
    if not done:
        reason = output
        if arguments[2] == "-D":
            # gone meanwhile (the engine removed it itself): nothing left to do
            log.debug("%s: %s %s: %s", key, tool, shlex.join(arguments), reason)
        else:
            _tell_once(tool, f"{key}: cannot read the port forwarding with {tool}: {reason}")
        return None
    return output


def _tell_once(tool: str, message: str) -> None:
    with _told_lock:
        if tool in _told:
            return
        _told.add(tool)
    log.warning("%s (left forwarding rules of gone containers are not removed)", message)
