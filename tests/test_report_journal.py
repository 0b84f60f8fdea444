"""`gpuresa report` on a journal and telemetry built by hand: every figure checked.

The journal is written through the daemon's own tables (`Journal`), the
telemetry through its `UsageStore`, so the reader meets what a daemon leaves.
The week of 2026-11-02 (Monday) in Europe/Paris:

| booking | user | GPUs | booked (Paris) | what happened | booked | held | busy |
| --- | --- | --- | --- | --- | --- | --- | --- |
| a1 | alice | 2 | Tue 09-13 | ran 09-12, GPUs 50 % busy | 8 | 6 | 3 |
| b1 | bob | 1 | Wed 10-12 | ran 10-12, GPUs idle: a no-show | 2 | 2 | 0 |
| b2 | bob | 1 | Thu 10-14 | cancelled on Wednesday | 0 | 0 | 0 |
| d1 | dave | 4 | Sun 20:00 - Mon 02:00 | never ran, 2 h in the week | 8 | 0 | 0 |
| v1 | alice | 1 | Fri 10-12 | gone from the calendar on Monday | 0 | 0 | 0 |
| e1 | erin | 1 | Fri 14-16 | still running, no telemetry | 2 | 2 | ? |
| c1 | carol | 1 | on gpu2 | another host's: left out | | | |

Refusals: bob's conflict (Fri), frank's unknown template in the shared
calendar (Sat); one of the week before and one of gpu2's calendar are left out.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuresa.cli import main
from gpuresa.config.reading import parse_config
from gpuresa.daemon import journal_path
from gpuresa.gpus.usage_store import USAGE_FILE, UsageStore
from gpuresa.journal.store import Journal
from gpuresa.model import Rejection, Reservation
from gpuresa.reports.groups import NO_GROUP, group_lookup
from gpuresa.reports.reading import _BOOKINGS, _EVENTS, JOURNAL_FILE, read_facts
from gpuresa.reports.usage import Period, StateChange, held_intervals

PARIS = ZoneInfo("Europe/Paris")
WEEK = ["--from", "2026-11-02", "--to", "2026-11-08"]


def at(day: int, hour: float) -> datetime:
    """November `day`, 2026, at `hour` in Paris."""
    return datetime(2026, 11, day, tzinfo=PARIS) + timedelta(hours=hour)


def reservation(
    key: str,
    user: str,
    gpus: int,
    start: datetime,
    end: datetime,
    host: str = "gpu1",
    calendar: str = "gpu1",
) -> Reservation:
    return Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar=calendar,
        host=host,
        user=user,
        template="pytorch",
        cuda=None,
        gpus=gpus,
        start=start,
        end=end,
        email=None,
    )


def rejection(key: str, user: str, calendar: str, reason: str, start: datetime) -> Rejection:
    return Rejection(key, key, calendar, reason, user, None, start, start + timedelta(hours=1))


def run_session(
    journal: Journal, key: str, user: str, gpus: str, start: datetime, end: datetime | None
) -> None:
    """The changes and start action a daemon journals for a session from `start` to `end`."""
    journal.states.set(key, "preparing", start - timedelta(minutes=5))
    journal.history.record_action(
        key, f"start {key} for {user} (GPUs {gpus}, ssh 2201, ftp 2301)", start, "ok"
    )
    journal.states.set(key, "running", start, "ssh port 2201")
    if end is not None:
        journal.states.set(key, "warned", end - timedelta(minutes=15))
        journal.states.set(key, "stopping", end, "ended")
        journal.states.set(key, "ended", end, "ended")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """The config of a host gpu1 whose state dir holds the week described above."""
    state = tmp_path / "state"
    calendar = tmp_path / "calendar"
    calendar.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
[daemon]
host = "gpu1"
state_dir = "{state}"
[reservations]
timezone = "Europe/Paris"
[[calendars]]
name = "gpu1"
kind = "ics"
url = "{calendar}"
host = "gpu1"
[[calendars]]
name = "shared"
kind = "ics"
url = "{calendar}"
[[calendars]]
name = "gpu2"
kind = "ics"
url = "{calendar}"
host = "gpu2"
[[hosts]]
name = "gpu1"
gpus = [0, 1, 2, 3]
[[hosts]]
name = "gpu2"
gpus = [0, 1]
[rules.groups.vision]
members = ["alice", "bob"]
"""
    )
    journal = Journal(state / "journal.sqlite")
    monday = at(2, 8)
    a1 = reservation("a1", "alice", 2, at(3, 9), at(3, 13))
    b1 = reservation("b1", "bob", 1, at(4, 10), at(4, 12))
    b2 = reservation("b2", "bob", 1, at(5, 10), at(5, 14))
    d1 = reservation("d1", "dave", 4, at(1, 20), at(2, 2))
    v1 = reservation("v1", "alice", 1, at(6, 10), at(6, 12))
    e1 = reservation("e1", "erin", 1, at(6, 14), at(6, 16))
    c1 = reservation("c1", "carol", 1, at(3, 9), at(3, 13), host="gpu2", calendar="gpu2")
    refusals = [
        rejection("r1", "bob", "gpu1", "overlaps another booking on host gpu1 from …", at(6, 9)),
        rejection("r2", "frank", "shared", "unknown template 'tf' (templates: pytorch)", at(7, 9)),
        rejection("r3", "bob", "gpu1", "it ends before it starts", at(1, 9)),  # the week before
        rejection("r4", "carol", "gpu2", "3 GPUs asked, but host 'gpu2' has 2", at(4, 9)),
    ]
    # v1 is seen on Monday only: it was deleted from the calendar before it started
    journal.reservations.record([a1, b1, b2, d1, v1, e1, c1], refusals, monday)
    journal.reservations.record([a1, b1, b2, d1, e1, c1], [], at(6, 15))
    journal.calendars.record("gpu1", at(6, 15), None, at(6, 15))
    for item in (a1, b1, b2, d1, v1, e1):
        journal.states.set(item.key, "booked", monday)
    run_session(journal, "a1", "alice", "[0, 1]", at(3, 9), at(3, 12))
    run_session(journal, "b1", "bob", "[2]", at(4, 10), at(4, 12))
    journal.states.set("b2", "cancelled", at(4, 9), "the event was removed")
    run_session(journal, "e1", "erin", "[3]", at(6, 14), None)
    journal.close()
    usage = UsageStore(state / USAGE_FILE)
    for minute in range(0, 180, 30):
        usage.add_sample("a1", "alice", at(3, 9) + timedelta(minutes=minute), 50.0, 2e9)
        usage.add_sample("b1", "bob", at(4, 10) + timedelta(minutes=minute // 2), 0.0, 1e9)
    usage.end(["a1", "b1"], at(4, 12))
    usage.close()
    return config


def report(site: Path, capsys: pytest.CaptureFixture[str], *options: str) -> str:
    assert main(["report", "--config", str(site), *WEEK, *options]) == 0
    return capsys.readouterr().out


def test_the_figures_of_a_hand_built_week(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = json.loads(report(site, capsys, "--json"))
    rows = {row["key"]: row for row in document["rows"]}
    assert sorted(rows) == ["alice", "bob", "dave", "erin", "frank"]
    alice, bob, dave, erin = rows["alice"], rows["bob"], rows["dave"], rows["erin"]
    assert (alice["booked_gpu_hours"], alice["held_gpu_hours"]) == (8.0, 6.0)
    assert (alice["busy_gpu_hours"], alice["sessions"], alice["no_shows"]) == (3.0, 1, 0)
    assert (bob["booked_gpu_hours"], bob["held_gpu_hours"], bob["busy_gpu_hours"]) == (2, 2, 0)
    assert (bob["sessions"], bob["no_shows"], bob["refused"]) == (1, 1, {"conflict": 1})
    assert (dave["booked_gpu_hours"], dave["held_gpu_hours"], dave["sessions"]) == (8, 0, 0)
    # erin's session never ended in the journal: held until its booking's end, unmeasured
    assert erin["booked_gpu_hours"] == erin["held_gpu_hours"] == 2.0
    assert erin["unmeasured_gpu_hours"] == 2.0
    assert rows["frank"]["refused"] == {"unknown template": 1}
    total = document["total"]
    assert total["booked_gpu_hours"] == 20.0
    assert total["busy_gpu_hours"] == 3.0
    assert (total["sessions"], total["no_shows"]) == (3, 1)
    assert total["refused"] == {"conflict": 1, "unknown template": 1}
    assert document["from"] == "2026-11-01T23:00:00+00:00"
    assert document["to"] == "2026-11-08T23:00:00+00:00"


def test_by_gpu_and_by_group(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    by_gpu = json.loads(report(site, capsys, "--json", "--by", "gpu"))
    rows = {row["key"]: row for row in by_gpu["rows"]}
    assert rows["gpu1:0"]["held_gpu_hours"] == rows["gpu1:1"]["held_gpu_hours"] == 3.0
    assert rows["gpu1:2"]["no_shows"] == 1
    assert rows["gpu1:?"]["booked_gpu_hours"] == 8.0  # dave's, never placed
    by_group = json.loads(report(site, capsys, "--json", "--by", "group"))
    groups = {row["key"]: row["booked_gpu_hours"] for row in by_group["rows"]}
    # alice and bob are [rules.groups.vision]; dave and erin have no account here
    assert groups == {"(none)": 10.0, "vision": 10.0}


def test_csv_and_table_carry_the_same_figures(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = list(csv.DictReader(io.StringIO(report(site, capsys, "--csv"))))
    by_key = {row["user"]: row for row in rows}
    assert by_key["alice"]["busy_gpu_hours"] == "3.00"
    assert by_key["total"]["refused:conflict"] == "1"
    table = report(site, capsys)
    assert "2026-11-02 00:00 to 2026-11-09 00:00 (Europe/Paris), by user" in table
    alice = next(line for line in table.splitlines() if line.startswith("alice"))
    assert alice.split()[1:7] == ["8.00", "6.00", "3.00", "0.00", "1", "0"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--from", "2026-13-01"], "--from: expected a date"),
        (["--to", "next week"], "--to: expected a date"),
        (["--from", "2026-11-09", "--to", "2026-11-02"], "must end after it starts"),
    ],
)
def test_bad_dates_are_refused_with_the_option(
    site: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    assert main(["report", "--config", str(site), *options]) == 1
    assert message in capsys.readouterr().err


def test_without_a_journal_the_report_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{tmp_path}"\n[[hosts]]\nname = "gpu1"\n'
    )
    assert main(["report", "--config", str(config)]) == 1
    assert "no journal yet" in capsys.readouterr().err


def test_the_queries_use_the_journal_indexes(site: Path) -> None:
    """Bounded by the host and the period: bookings through reservations_by_host_end,
    their events by key."""
    connection = sqlite3.connect(site.parent / "state" / "journal.sqlite")
    try:
        parameters = ("2026-11-01T00:00:00", "2026-11-09T00:00:00", "gpu1")
        plans = {
            name: " ".join(
                str(row[-1]) for row in connection.execute(f"EXPLAIN QUERY PLAN {sql}", parameters)
            )
            for name, sql in (("bookings", _BOOKINGS), ("events", _EVENTS))
        }
    finally:
        connection.close()
    assert "reservations_by_host_end (host=? AND end_at>?)" in plans["bookings"]
    assert "reservations_by_host_end" in plans["events"] and "events_by_key" in plans["events"]
    assert "SCAN e" not in plans["events"]


def test_a_login_counts_for_its_rules_group_else_its_unix_group() -> None:
    base = {"daemon": {"host": "gpu1"}, "hosts": [{"name": "gpu1"}]}
    plain = group_lookup(parse_config(base))
    assert plain("root") == "root"  # its primary Unix group
    assert plain("no-such-login-here") == NO_GROUP
    ruled = group_lookup(
        parse_config(
            base | {"rules": {"groups": {"b": {"members": ["root"]}, "a": {"members": ["root"]}}}}
        )
    )
    assert ruled("root") == "a"  # the first by name of the groups listing it


def test_the_report_reads_the_daemons_journal_file(tmp_path: Path) -> None:
    config = parse_config({"daemon": {"host": "gpu1", "state_dir": str(tmp_path)}})
    assert journal_path(config) == tmp_path / JOURNAL_FILE


# every state a session may go through, warned and stopping included
TRANSITIONS = ("booked", "preparing", "running", "warned", "stopping", "ended", "failed",
               "running", "released", "cancelled", "preempted", "running")  # fmt: skip


@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(TRANSITIONS), st.integers(0, 3)), max_size=12),
        min_size=1,
        max_size=4,
    )
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_journal_query_finds_the_holdings_the_definition_gives(
    histories: list[list[tuple[str, int]]],
) -> None:
    """The SQL that derives holdings from the journal agrees with `held_intervals`, for any
    sequence of changes (some in the same instant), written by the daemon's own table."""
    with tempfile.TemporaryDirectory() as folder:
        journal = Journal(Path(folder) / JOURNAL_FILE)
        start = at(3, 0)
        changes = []
        for number, history in enumerate(histories):
            key = f"k{number}"
            journal.reservations.record(
                [reservation(key, "alice", 1, start, start + timedelta(hours=9))], [], start
            )
            instant = start
            for state, step in history:
                instant += timedelta(minutes=step)  # 0: the same instant as the change before
                if journal.states.set(key, state, instant):
                    changes.append(StateChange(key, instant, state))
        journal.close()
        period = Period(start - timedelta(days=1), start + timedelta(days=1))
        found = read_facts(Path(folder) / JOURNAL_FILE, None, period, "gpu1", {}).holdings
    assert found == held_intervals(changes)
