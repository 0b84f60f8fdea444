"""[rules] in the config: every check rejecting with its key path, the documented example read
back, and groups taken from real host groups (groupadd/useradd, removed after)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import run_login
from support.configs import config_of

from gpuresa.config.reading import parse_config
from gpuresa.config.rules_sections import LIMIT_KEYS, RuleLimits
from gpuresa.errors import ConfigError
from gpuresa.fairshare.host_groups import host_members
from gpuresa.fairshare.limits import groups_of, limits_for

EXAMPLE = Path(__file__).parents[1] / "config.example.toml"


def problems_of(rules: object) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config({"rules": rules}, "test.toml")
    return caught.value.problems


def test_the_limit_keys_are_the_fields_of_every_level() -> None:
    assert {field.name for field in fields(RuleLimits)} == set(LIMIT_KEYS)


@pytest.mark.parametrize(
    ("rules", "problem"),
    [
        ({"max_gpus": -1}, "rules.max_gpus: must be 0 or more, got -1"),
        ({"max_gpus": 1.5}, 'rules.max_gpus: expected an integer, or "unlimited", got 1.5'),
        ({"max_gpu_hours": -2}, "rules.max_gpu_hours: must be 0 or more, got -2.0"),
        ({"max_ahead": "0s"}, 'rules.max_ahead: must be more than 0 (or "unlimited")'),
        ({"max_duration": "3"}, 'rules.max_duration: expected a duration such as "14d"'),
        ({"max_bookings": "many"}, "rules.max_bookings: expected an integer"),
        ({"min_gap": "unlimited"}, 'rules.min_gap: expected a duration such as "1h"'),
        ({"period": "year"}, "rules.period: expected 'day' or 'week' or 'month'"),
        ({"groups_from": "ldap"}, "rules.groups_from: expected 'config' or 'unix'"),
        ({"max_gpu": 2}, "rules.max_gpu: unknown key"),
        ({"groups": {"students": {"members": ["Alice!"]}}}, "rules.groups.students.members"),
        ({"groups": {"students": {"max_gpus": -3}}}, "rules.groups.students.max_gpus: must be"),
        ({"groups": {"students": {"member": ["alice"]}}}, "rules.groups.students.member: unknown"),
        ({"users": {"alice": {"members": ["bob"]}}}, "rules.users.alice.members: unknown key"),
        ({"users": {"Not A Login": {"max_gpus": 1}}}, "rules.users: not valid logins"),
    ],
)
def test_each_check_rejects_with_its_key_path(rules: object, problem: str) -> None:
    assert any(found.startswith(problem) for found in problems_of(rules)), problems_of(rules)


def test_every_problem_is_listed_at_once() -> None:
    found = problems_of({"max_gpus": -1, "groups": {"g": {"max_ahead": "soon"}}, "x": 1})
    assert len(found) == 3


def test_the_documented_group_and_user_tables_read_back() -> None:
    """The indented example of config.example.toml's [rules] is a valid config."""
    text = EXAMPLE.read_text()
    block = text[text.index("[rules]") :]
    lines = [line[4:] for line in block.splitlines() if re.match(r"^#   \S", line)]
    config = parse_config(tomllib.loads("\n".join(lines)), "example")
    rules = config.rules
    assert set(rules.groups) == {"students", "staff"}
    assert groups_of("alice", rules) == ("staff", "students")
    alice = limits_for("alice", rules)
    # as the example says: staff's 96 GPU-hours; max_gpus unset in staff and by default
    assert alice["max_gpu_hours"].value == 96
    assert "max_gpus" not in alice
    assert "max_duration" not in limits_for("bob", rules)


def test_unlimited_and_unset_differ_per_level() -> None:
    rules = config_of(
        {"rules": {"max_duration": "4h", "users": {"bob": {"max_duration": "unlimited"}}}}
    ).rules
    assert limits_for("alice", rules)["max_duration"].value == timedelta(hours=4)
    assert limits_for("bob", rules) == {}


@pytest.fixture
def host_group() -> Iterator[tuple[str, str, str]]:
    """A Unix group with a member listed in /etc/group and one whose primary group it is:
    (group, listed login, primary login); all removed afterwards."""
    group, listed, primary = run_login("gfs"), run_login("gfl"), run_login("gfp")
    subprocess.run(["groupadd", group], check=True)
    made: list[str] = []
    try:
        for login, options in ((listed, ["-G", group]), (primary, ["-g", group])):
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/bin/sh", *options, login], check=True
            )
            made.append(login)
        yield group, listed, primary
    finally:
        for login in made:
            subprocess.run(["userdel", login], check=False)
        subprocess.run(["groupdel", group], check=False)


def test_unix_groups_come_from_the_host(host_group: tuple[str, str, str]) -> None:
    group, listed, primary = host_group
    table = {"groups_from": "unix", "groups": {group: {"max_gpus": 1}, "gfs-none": {}}}
    rules = config_of({"rules": table}).rules
    members = host_members(rules)
    assert members[group] == {listed, primary}
    assert members["gfs-none"] == frozenset()  # no such group on this host: nobody
    for login in (listed, primary):
        assert groups_of(login, rules, members) == (group,)
        assert limits_for(login, rules, members)["max_gpus"].source == f"group {group}"
    assert groups_of("root", rules, members) == ()
    # with groups_from = "config" the host is not read
    assert host_members(config_of({"rules": {**table, "groups_from": "config"}}).rules) == {}
