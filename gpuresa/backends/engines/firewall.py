"""The sessions' firewall: host accounts reach no session address, only what is published.

A session's bridge network is routable from the host: without this, any host
account could connect to every port a session listens on but never published
(a notebook, TensorBoard, `python3 -m http.server` serving its results). Each
session network gets one rule in gpuresa's own chain of the filter table,
GPURESA-SESSIONS, jumped to first from OUTPUT:

    -A GPURESA-SESSIONS -d <the network's subnet>
       -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -m owner ! --uid-owner 0
       -m comment --comment "gpuresa <installation> <network name>" -j REJECT

What it lets through, and why:
- root's own processes (the daemon's checks, the engines' proxies, the
  admin): trusted; a host account is never root;
- published ports: on Podman, traffic to a published port is DNATed in nat
  OUTPUT before filter OUTPUT sees it, so it arrives here with the container's
  address as its destination; the DNAT state tells it apart (Docker's
  userland proxy connects as root);
- replies and errors of connections the session opened (ESTABLISHED,
  RELATED; kernel packets have no owner and would otherwise match);
- traffic between a session's containers and SSH forwarding from inside:
  bridge traffic, which never passes the host's OUTPUT chain.

The rule is added as soon as the network exists, before any container of it
starts, and a session whose rule cannot be added is not started (fail
closed: the daemon needs iptables and CAP_NET_ADMIN, with netlink sockets
for the nf_tables backend). It goes when the session's network goes, and the
cleanup removes this installation's rules whose network is gone or now has
another subnet. The chain and its jump stay: removing them when the chain
looks empty would race another process adding a session's rule.
"""

from __future__ import annotations

import logging
import shlex
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.forwarding import netfilter
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import HOST_LABEL, NETWORK_ROLE, ROLE_LABEL

log = logging.getLogger(__name__)

CHAIN = "GPURESA-SESSIONS"
COMMENT_PREFIX = "gpuresa"
# one add at a time in this process: a check and an append must not interleave
_lock = threading.Lock()


def tool_for(subnet: str) -> str:
    """The iptables tool of a subnet's family."""
    return "ip6tables" if ":" in subnet else "iptables"


def comment(installation: str, network: str) -> str:
    """The comment that names a rule's owner and session network."""
    return f"{COMMENT_PREFIX} {installation} {network}"


def guard_rule(subnet: str, installation: str, network: str) -> list[str]:
    """The arguments, after `-A CHAIN`, of the rule that closes `subnet` to host accounts."""
    return [
        "-d", subnet,
        "-m", "conntrack", "!", "--ctstate", "RELATED,ESTABLISHED,DNAT",
        "-m", "owner", "!", "--uid-owner", "0",
        "-m", "comment", "--comment", comment(installation, network),
        "-j", "REJECT",
    ]  # fmt: skip


def network_subnets(network: Mapping[str, Any]) -> list[str]:
    """The subnets of a network's `inspect` or listing (IPAM configs)."""
    configs = (network.get("IPAM") or {}).get("Config") or []
    return [str(config["Subnet"]) for config in configs if config.get("Subnet")]


def rule_owner(text: str) -> tuple[str, str, str] | None:
    """(installation, network, subnet) of a rule as `-S CHAIN` writes it; None if not ours."""
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    if words[:2] != ["-A", CHAIN] or "--comment" not in words or "-d" not in words:
        return None
    parts = words[words.index("--comment") + 1].split(" ")
    destination = words[words.index("-d") + 1]
    if len(parts) != 3 or parts[0] != COMMENT_PREFIX:
        return None
    return parts[1], parts[2], destination


def rules_to_collect(
    listing: str, installation: str, networks: Collection[tuple[str, str]]
) -> list[str]:
    """The rules of `listing` (`-S CHAIN`) that this installation no longer needs. Pure.

    Given the (name, subnet) pairs of the session networks that exist. A rule
    of another installation, or that gpuresa did not write, is never among them.
    """
    stale = []
    for line in listing.splitlines():
        owner = rule_owner(line.strip())
        if owner is None or owner[0] != installation:
            continue
        if not any(name == owner[1] and same_subnet(subnet, owner[2]) for name, subnet in networks):
            stale.append(line.strip())
    return stale


def same_subnet(engine_subnet: str, rule_subnet: str) -> bool:
    """Whether a rule's destination is the engine's subnet (iptables drops a `/32`)."""
    return engine_subnet == rule_subnet or engine_subnet == f"{rule_subnet}/32"


def guard(installation: str, network: str, subnets: Iterable[str], key: str) -> None:
    """Close `subnets` of session network `network` to host accounts; idempotent.

    Raises `SessionError` when a rule cannot be added (or there is no subnet).
    """
    subnets = list(subnets)
    if not subnets:
        raise SessionError(f"session {key}: its network {network} has no subnet to close")
    with _lock:
        for subnet in subnets:
            tool = tool_for(subnet)
            _ensure_chain(tool, key)
            rule = guard_rule(subnet, installation, network)
            if netfilter(tool, ["-C", CHAIN, *rule])[0]:
                continue
            _must(tool, ["-A", CHAIN, *rule], key)
            log.info("%s: host accounts closed out of %s (%s)", key, subnet, network)


def guard_network(engine: Engine, installation: str, network_id: str, key: str) -> None:
    """`guard` the session network `network_id` with the subnets the engine gave it."""
    network = engine.network(network_id)
    if network is None:
        raise SessionError(f"session {key}: its network {network_id} vanished as it was made")
    guard(installation, str(network.get("Name") or network_id), network_subnets(network), key)


def unguard(installation: str, network: str, key: str) -> list[str]:
    """Remove this installation's rules for session network `network`; the rules removed.

    Called once the network is gone; logs, never raises (a rule left is
    collected by the cleanup, and closes only a subnet nobody uses).
    """
    return remove_rules(
        lambda owner: owner[:2] == (installation, network), f"{key}: its network is gone"
    )


def collect(engine: Engine, host: str, installation: str) -> list[str]:
    """Remove this installation's rules whose session network is gone; the rules removed.

    The rules are read before the networks are listed, so a network made
    meanwhile (and its fresh rule) is never taken for a gone one. Logs,
    never raises.
    """
    removed = []
    for tool in ("iptables", "ip6tables"):
        done, listing = netfilter(tool, ["-S", CHAIN])
        if not done:
            # no chain yet (no session ever had a rule), or no ip6tables
            log.debug("no %s rules to collect: %s", tool, listing)
            continue
        networks = engine.networks(
            {"label": [f"{HOST_LABEL}={host}", f"{ROLE_LABEL}={NETWORK_ROLE}"]}
        )
        existing = {
            (str(network.get("Name")), subnet)
            for network in networks
            for subnet in network_subnets(network)
        }
        for rule in rules_to_collect(listing, installation, existing):
            if _delete(tool, rule, "session network gone"):
                removed.append(rule)
    return removed


def remove_rules(wanted: Callable[[tuple[str, str, str]], bool], why: str) -> list[str]:
    """Remove the rules whose (installation, network, subnet) is `wanted`; those removed.

    `why` is logged with each. Logs, never raises.
    """
    removed = []
    for tool in ("iptables", "ip6tables"):
        done, listing = netfilter(tool, ["-S", CHAIN])
        if not done:
            continue
        for line in listing.splitlines():
            owner = rule_owner(line.strip())
            if owner is not None and wanted(owner) and _delete(tool, line.strip(), why):
                removed.append(line.strip())
    return removed


def _delete(tool: str, rule: str, why: str) -> bool:
    done, reason = netfilter(tool, ["-D", *shlex.split(rule)[1:]])
    if done:
        log.info("%s: removed the firewall rule %s", why, rule)
    else:
        # removed meanwhile by another process: nothing left to do
        log.debug("%s: %s -D %s: %s", why, tool, rule, reason)
    return done


def _ensure_chain(tool: str, key: str) -> None:
    """GPURESA-SESSIONS, jumped to first from OUTPUT (before any site rule that accepts)."""
    if not netfilter(tool, ["-S", CHAIN])[0]:
        done, reason = netfilter(tool, ["-N", CHAIN])
        # made by another process meanwhile: as good
        if not done and not netfilter(tool, ["-S", CHAIN])[0]:
            _refuse(tool, reason, key)
    if not netfilter(tool, ["-C", "OUTPUT", "-j", CHAIN])[0]:
        _must(tool, ["-I", "OUTPUT", "1", "-j", CHAIN], key)


def _must(tool: str, arguments: list[str], key: str) -> None:
    done, reason = netfilter(tool, arguments)
    if not done:
        _refuse(tool, reason, key)


def _refuse(tool: str, reason: str, key: str) -> None:
    raise SessionError(
        f"session {key}: its network cannot be closed to host accounts with {tool} ({reason}); "
        "the daemon needs iptables on its PATH and CAP_NET_ADMIN with netlink sockets"
    )
