"""The host's Unix groups, for [rules] groups_from = "unix": who is in each configured group.

The edge of the fair-share rules (it reads the host's group and password
databases); what it returns is a plain value the pure rules take in
(`gpuresa.fairshare.check.RuleFacts.host_members`).
"""

from __future__ import annotations

import grp
import logging
import pwd

from gpuresa.config.rules_sections import RulesConfig

log = logging.getLogger(__name__)

# the configured groups the host was found without, warned about once per process
_MISSING_WARNED: set[str] = set()


def host_members(rules: RulesConfig) -> dict[str, frozenset[str]]:
    """Each configured group's logins on this host: the group's member list, and the
    logins whose primary group it is (which /etc/group does not list).

    Empty unless groups_from = "unix". A configured group the host does not have
    has no member here (logged once); its `members` list still counts.
    """
    if rules.groups_from != "unix" or not rules.groups:
        return {}
    found: dict[str, frozenset[str]] = {}
    by_primary: dict[int, set[str]] | None = None
    for name in rules.groups:
        try:
            entry = grp.getgrnam(name)
        except KeyError:
            if name not in _MISSING_WARNED:
                _MISSING_WARNED.add(name)
                log.warning("[rules.groups.%s]: this host has no Unix group %r", name, name)
            found[name] = frozenset()
            continue
        if by_primary is None:
            # read once per call, and only when a group exists: primary groups are not listed
            by_primary = {}
            for account in pwd.getpwall():
                by_primary.setdefault(account.pw_gid, set()).add(account.pw_name)
        found[name] = frozenset(entry.gr_mem) | frozenset(by_primary.get(entry.gr_gid, ()))
    return found
