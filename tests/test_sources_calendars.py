"""Calendars: every calendar polled each round; a failing one falls back to its snapshot."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from support.configs import config_of

from gpuresa.config.sections import Config
from gpuresa.reservations.calendars import CalendarFreshness, Calendars

NOW = datetime(2026, 3, 10, 12, tzinfo=UTC)


def event_text(uid: str, start: datetime, hours: int = 2, summary: str = "alice") -> str:
    end = start + timedelta(hours=hours)
    return (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:test\r\nBEGIN:VEVENT\r\n"
        f"UID:{uid}\r\nDTSTAMP:20260301T000000Z\r\n"
        f"DTSTART:{start:%Y%m%dT%H%M%SZ}\r\nDTEND:{end:%Y%m%dT%H%M%SZ}\r\n"
        f"SUMMARY:{summary}\r\nDESCRIPTION:template: pytorch\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    )


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def make_config(tmp_path: Path, *calendars: dict[str, Any]) -> Config:
    return config_of(
        {
            "daemon": {"host": "gpu1", "state_dir": str(tmp_path / "state")},
            "reservations": {"window_past": "1d", "window_ahead": "14d"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "calendars": list(calendars),
        }
    )


def test_one_calendar_failing_does_not_stop_the_others(tmp_path: Path) -> None:
    folder = tmp_path / "ics"
    folder.mkdir()
    (folder / "a.ics").write_text(event_text("from-ics", NOW + timedelta(days=1)))
    config = make_config(
        tmp_path,
        {"name": "files", "kind": "ics", "url": str(folder), "host": "gpu1"},
        {"name": "down", "url": f"http://127.0.0.1:{unused_port()}/cal/", "host": "gpu1"},
    )
    report = Calendars(config).poll(NOW)
    assert [item.key for item in report.reservations.reservations] == ["from-ics"]
    assert report.freshness["files"] == CalendarFreshness(
        report.freshness["files"].last_success, None, report.freshness["files"].stale_seconds
    )
    assert report.freshness["files"].last_success is not None
    down = report.freshness["down"]
    assert down.last_success is None and down.stale_seconds is None
    assert down.last_error is not None and "Connection refused" in down.last_error


def test_the_window_runs_from_window_past_to_window_ahead(tmp_path: Path) -> None:
    folder = tmp_path / "ics"
    folder.mkdir()
    cases = {
        "ended-2-days-ago": NOW - timedelta(days=2, hours=2),
        "ended-yesterday": NOW - timedelta(hours=20),
        "running": NOW - timedelta(hours=1),
        "in-13-days": NOW + timedelta(days=13),
        "in-15-days": NOW + timedelta(days=15),
    }
    for uid, start in cases.items():
        (folder / f"{uid}.ics").write_text(event_text(uid, start))
    config = make_config(
        tmp_path, {"name": "files", "kind": "ics", "url": str(folder), "host": "gpu1"}
    )
    report = Calendars(config).poll(NOW)
    assert [item.key for item in report.reservations.reservations] == [
        "ended-yesterday",
        "running",
        "in-13-days",
    ]


def test_a_restart_reads_the_snapshots_without_any_server(tmp_path: Path) -> None:
    folder = tmp_path / "ics"
    folder.mkdir()
    (folder / "a.ics").write_text(event_text("kept", NOW + timedelta(hours=3)))
    config = make_config(
        tmp_path, {"name": "files", "kind": "ics", "url": str(folder), "host": "gpu1"}
    )
    Calendars(config).poll(NOW)
    (folder / "a.ics").unlink()
    folder.rmdir()
    restarted = Calendars(config)
    from_disk = restarted.from_snapshots(NOW)
    assert [item.key for item in from_disk.reservations.reservations] == ["kept"]
    report = restarted.poll(NOW + timedelta(minutes=5))
    assert [item.key for item in report.reservations.reservations] == ["kept"]
    freshness = report.freshness["files"]
    assert freshness.last_error is not None and "no such file or folder" in freshness.last_error
    assert freshness.stale_seconds is not None and freshness.stale_seconds >= 300


def test_a_calendar_that_comes_back_is_fresh_again(tmp_path: Path) -> None:
    folder = tmp_path / "ics"
    config = make_config(
        tmp_path, {"name": "files", "kind": "ics", "url": str(folder), "host": "gpu1"}
    )
    calendars = Calendars(config)
    assert calendars.poll(NOW).freshness["files"].last_error is not None
    folder.mkdir()
    (folder / "a.ics").write_text(event_text("back", NOW + timedelta(hours=3)))
    report = calendars.poll(NOW)
    assert report.freshness["files"].last_error is None
    assert [item.key for item in report.reservations.reservations] == ["back"]


def test_a_broken_file_in_a_folder_is_refused_alone_and_the_rest_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "ics"
    folder.mkdir()
    (folder / "alice.ics").write_text(event_text("alice-1", NOW + timedelta(days=1)))
    config = make_config(
        tmp_path, {"name": "files", "kind": "ics", "url": str(folder), "host": "gpu1"}
    )
    calendars = Calendars(config)
    assert [item.key for item in calendars.poll(NOW).reservations.reservations] == ["alice-1"]
    # a file that is only a start, a new booking and a cancellation, in one moment
    (folder / "broken.ics").write_text("BEGIN:VCALENDAR\r\n")
    (folder / "bob.ics").write_text(event_text("bob-1", NOW + timedelta(days=2), summary="bob"))
    (folder / "alice.ics").unlink()
    report = calendars.poll(NOW)
    assert [item.key for item in report.reservations.reservations] == ["bob-1"]
    [refused] = report.reservations.rejected
    assert (refused.key, refused.user, refused.start, refused.calendar) == (
        "broken.ics",
        None,
        None,
        "files",
    )
    assert f"{folder / 'broken.ics'}: it is incomplete" in refused.reason
    assert refused.reason.endswith("nothing in it is booked until it can")
    assert report.freshness["files"].last_error is None
    # the same file, once whole, is read; its rejection goes
    (folder / "broken.ics").write_text(
        event_text("carol-1", NOW + timedelta(days=3), summary="carol")
    )
    report = calendars.poll(NOW)
    assert [item.key for item in report.reservations.reservations] == ["bob-1", "carol-1"]
    assert report.reservations.rejected == ()
