"""The rules where calendars are read: before over-booking, in `gpuresa reservations`.

Calendar text through `read_reservations` (pure) and the command itself.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support.configs import config_of
from test_reservations import VARIANTS, event

from gpuresa.cli import main
from gpuresa.config.sections import Config
from gpuresa.fairshare.check import RuleFacts
from gpuresa.reservations.rules import read_reservations

NOW = datetime(2026, 3, 2, 12, tzinfo=UTC)
START = datetime(2026, 3, 10, 8, tzinfo=UTC)
WINDOW = (datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC))


def two_gpu_config(rules: dict[str, Any]) -> Config:
    return config_of(
        {
            "daemon": {"host": "gpu1"},
            "reservations": {"timezone": "UTC"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1]}],
            "calendars": [
                {
                    "name": "lab",
                    "url": "/lab.ics",
                    "kind": "ics",
                    "host": "gpu1",
                    "default_template": "pytorch",
                }
            ],
            "rules": rules,
        },
        base=False,
    )


BOOKINGS = [
    # alice's second booking breaks her week's 10 GPU-hours (4 + 8 > 10)
    ("a1.ics", event("alice", "gpus: 2", uid="alice-1", start=START, hours=2)),
    ("a2.ics", event("alice", "gpus: 2", uid="alice-2", start=START + timedelta(hours=3), hours=4)),
    # bob's overlaps alice's second, seen later: with both GPUs taken it would lose
    ("b1.ics", event("bob", "gpus: 2", uid="bob-1", start=START + timedelta(hours=4), hours=2)),
]
SEEN = {
    "alice-1": NOW - timedelta(days=3),
    "alice-2": NOW - timedelta(days=2),
    "bob-1": NOW - timedelta(days=1),
}


def test_a_refused_booking_takes_no_gpu_from_others() -> None:
    config = two_gpu_config({"max_gpu_hours": 10})
    found = read_reservations(
        config,
        {"lab": BOOKINGS},
        *WINDOW,
        variants=VARIANTS,
        first_seen=SEEN,
        rule_facts=RuleFacts(NOW),
    )
    assert [item.key for item in found.reservations] == ["alice-1", "bob-1"]
    [refused] = found.rejected
    assert refused.key == "alice-2" and refused.user == "alice"
    assert refused.reason == (
        "rule max_gpu_hours (default): alice has 6 of 10 GPU-hours left in the week "
        "Mon 9 Mar-Sun 15 Mar; this booking asks for 8"
    )
    # without rule facts (or with no rule), over-booking alone decides: bob loses
    plain = read_reservations(
        config, {"lab": BOOKINGS}, *WINDOW, variants=VARIANTS, first_seen=SEEN
    )
    assert [item.key for item in plain.rejected] == ["bob-1"]
    no_rules = two_gpu_config({})
    plain = read_reservations(
        no_rules,
        {"lab": BOOKINGS},
        *WINDOW,
        variants=VARIANTS,
        first_seen=SEEN,
        rule_facts=RuleFacts(NOW),
    )
    assert [item.key for item in plain.rejected] == ["bob-1"]


def test_a_booking_that_runs_is_kept_whatever_the_rules_say() -> None:
    config = two_gpu_config({"max_gpu_hours": 10})
    found = read_reservations(
        config,
        {"lab": BOOKINGS},
        *WINDOW,
        variants=VARIANTS,
        first_seen=SEEN,
        holding=frozenset({"alice-2"}),
        rule_facts=RuleFacts(NOW),
    )
    # alice-2 holds its session: it counts first, and alice-1 is the one over the limit
    assert [item.key for item in found.rejected] == ["alice-1", "bob-1"]
    assert found.rejected[0].reason.startswith("rule max_gpu_hours (default): alice has 2 of 10")


def test_the_reservations_command_shows_the_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    for name, text in BOOKINGS:
        (folder / name).write_text(text)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{tmp_path / "state"}"\n'
        '[reservations]\ntimezone = "Europe/Paris"\n'
        '[[hosts]]\nname = "gpu1"\ngpus = [0, 1]\n'
        f'[[calendars]]\nname = "lab"\nkind = "ics"\nurl = "{folder}"\nhost = "gpu1"\n'
        'default_template = "pytorch"\n'
        '[rules]\nmax_duration = "3h"\n'
    )
    window = ["--from", "2026-03-09", "--to", "2026-03-16"]
    assert main(["reservations", "--config", str(config), *window, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    reasons = {item["key"]: item["reason"] for item in report["rejected"]}
    assert reasons == {
        "alice-2": "rule max_duration (default): this booking lasts 4h; a booking of alice "
        "may last 3h at most"
    }
    # alice's refused booking leaves the GPUs to bob
    assert [item["key"] for item in report["reservations"]] == ["alice-1", "bob-1"]
    assert main(["reservations", "--config", str(config), *window]) == 0
    assert "alice-2 (lab): rule max_duration (default)" in capsys.readouterr().out
