"""Which group a login counts for in reports and metrics: the one place that decides it.

Each login counts for exactly one group, so that the figures of all groups
add up to the host's (a login counted in two groups would be counted twice
in a Grafana sum). The group is, in this order:

1. the first, by name, of the fair-share groups (`[rules.groups.<name>]`) the
   login is in: listed in `members`, or with `groups_from = "unix"` in the
   host's Unix group of that name (the rules' own lookup,
   `gpuresa.fairshare.limits.groups_of`, so reports and limits agree);
2. else the login's primary Unix group on this host (`pwd`, `grp`);
3. else `NO_GROUP` (a login without an account here: a cluster's users, say).

Reads the host's account databases (I/O): the report itself takes the result
as a plain function and stays pure.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Callable

from gpuresa.config.sections import Config
from gpuresa.fairshare.host_groups import host_members
from gpuresa.fairshare.limits import groups_of

NO_GROUP = "(none)"


def unix_group(login: str) -> str:
    """The primary Unix group of `login` on this host, or `NO_GROUP`."""
    try:
        gid = pwd.getpwnam(login).pw_gid
        return grp.getgrgid(gid).gr_name
    except (KeyError, OverflowError, ValueError):
        return NO_GROUP


def group_lookup(config: Config) -> Callable[[str], str]:
    """A function login → group (see the module docstring), each login looked up once."""
    rules = config.rules
    members = host_members(rules)
    known: dict[str, str] = {}

    def group_of(login: str) -> str:
        found = known.get(login)
        if found is None:
            configured = groups_of(login, rules, members)
            found = known[login] = configured[0] if configured else unix_group(login)
        return found

    return group_of
