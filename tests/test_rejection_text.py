"""How a refusal tells times: one form on a line, the site's time with its zone."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from support.configs import config_of
from test_reservations import START, event, write_config

from gpuresa.cli import main
from gpuresa.model import Reservation
from gpuresa.reservations.conflicts import resolve_conflicts, site_time

PARIS = {"reservations": {"timezone": "Europe/Paris"}}
# what must not be on a line that tells times in the site's zone
OTHER_FORMS = re.compile(r"UTC|[0-9]{8}T[0-9]{6}Z|T[0-9]{2}:[0-9]{2}:[0-9]{2}|\+00:00")


def booking(key: str, start_hours: float, hours: float, gpus: int = 4) -> Reservation:
    start = START + timedelta(hours=start_hours)
    return Reservation(
        key=key, uid=key, recurrence_id=None, calendar="lab", host="gpu1", user="alice",
        template="pytorch", cuda=None, gpus=gpus, start=start, end=start + timedelta(hours=hours),
    )  # fmt: skip


def test_site_time_names_the_zone_and_follows_daylight_saving() -> None:
    paris = ZoneInfo("Europe/Paris")
    assert site_time(START, paris) == "2026-03-10 09:00 CET"
    assert site_time(START + timedelta(days=30), paris) == "2026-04-09 10:00 CEST"
    assert site_time(START, ZoneInfo("UTC")) == "2026-03-10 08:00 UTC"


def test_an_overlap_is_told_in_the_site_time() -> None:
    found = resolve_conflicts(
        [booking("a-first", 0, 2), booking("b-second", 1, 2)], config_of(PARIS)
    )
    [rejection] = found.rejected
    assert rejection.reason.startswith(
        "overlaps another booking on host gpu1 from 2026-03-10 09:00 CET to 2026-03-10 11:00 CET "
    )
    assert not OTHER_FORMS.search(rejection.reason), rejection.reason


def test_a_refused_growth_is_told_in_the_site_time() -> None:
    grown = booking("running", 0, 3)
    found = resolve_conflicts(
        [grown, booking("next", 1, 2)],
        config_of(PARIS),
        holding={"running"},
        granted={"running": (START, START + timedelta(hours=1))},
        first_seen={"running": START - timedelta(days=2), "next": START - timedelta(days=1)},
    )
    [refusal] = found.rejected
    assert refusal.key == "running/growth"
    assert refusal.reason.startswith(
        "the change to 2026-03-10 09:00 CET – 2026-03-10 12:00 CET is not taken; the session "
        "keeps 2026-03-10 09:00 CET – 2026-03-10 10:00 CET"
    ), refusal.reason
    assert not OTHER_FORMS.search(refusal.reason), refusal.reason


def test_a_rejection_line_of_the_reservations_table_gives_times_one_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    weekly = "template: pytorch\\ngpus: 4"
    (folder / "first.ics").write_text(event(uid="a-first", description=weekly))
    (folder / "series.ics").write_text(
        event(uid="weekly", description=weekly, extra="RRULE:FREQ=WEEKLY;COUNT=2")
    )
    config = write_config(tmp_path, f'name = "lab"\nkind = "ics"\nurl = "{folder}"\nhost = "gpu1"')
    arguments = ["--config", str(config), "reservations", "--from", "2026-03-01"]
    assert main([*arguments, "--to", "2026-04-01"]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "overlaps" in line]
    assert line.startswith(
        "  2026-03-10 09:00 CET weekly, one occurrence (lab): overlaps another booking on host "
        "gpu1 from 2026-03-10 09:00 CET to 2026-03-10 11:00 CET which was booked at the same "
        "time (the UID decides)"
    ), line
    assert not OTHER_FORMS.search(line), line
    # the key itself, RECURRENCE-ID and all, is in the JSON
    assert main([*arguments, "--to", "2026-04-01", "--json"]) == 0
    assert '"key": "weekly@20260310T080000Z"' in capsys.readouterr().out
