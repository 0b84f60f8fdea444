"""The daemon's usage figures: counters that only grow, the week on the page and in /metrics.

A journal and a usage store written through the daemon's own tables: alice
(group vision) holds 2 GPUs from 09:00 on Tuesday 2026-11-03 (UTC), 50 % busy,
booked until 13:00; bob (no group) books 1 GPU from 10:00 to 11:00, never
started. The watch is refreshed at times given by hand.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import free_port
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.waiting import wait_for
from test_daemon_cli import write_ics_config
from test_daemon_telemetry import get

from gpuresa.cli import main
from gpuresa.config.reading import load_config, parse_config
from gpuresa.config.sections import Config
from gpuresa.daemon import Daemon
from gpuresa.gpus.usage_store import USAGE_FILE, UsageStore
from gpuresa.journal.store import Journal
from gpuresa.model import Reservation
from gpuresa.observe.metrics import registry_for
from gpuresa.observe.page import render_page
from gpuresa.observe.state import build_state
from gpuresa.reports.live import UsageWatch
from gpuresa.reports.reading import JOURNAL_FILE

TUESDAY = datetime(2026, 11, 3, tzinfo=UTC)
STARTED = TUESDAY + timedelta(hours=8)


def at(hour: float) -> datetime:
    return TUESDAY + timedelta(hours=hour)


def reservation(key: str, user: str, gpus: int, start: datetime, end: datetime) -> Reservation:
    return Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar="gpu1",
        host="gpu1",
        user=user,
        template="pytorch",
        cuda=None,
        gpus=gpus,
        start=start,
        end=end,
        email=None,
    )


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return parse_config(
        {
            "daemon": {"host": "gpu1", "state_dir": str(tmp_path)},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "rules": {"groups": {"vision": {"members": ["alice"]}}},
            # alice is a login of the site; bob, a name a calendar gave, is not
            "users": {"emails": {"alice": "alice@example.org"}},
        },
        "test.toml",
    )


@pytest.fixture
def watch(config: Config) -> UsageWatch:
    state = config.daemon.state_dir
    journal = Journal(state / "journal.sqlite")
    alice = reservation("a1", "alice", 2, at(9), at(13))
    bob = reservation("b1", "bob", 1, at(10), at(11))
    journal.reservations.record([alice, bob], [], STARTED)
    journal.states.set("a1", "running", at(9))
    journal.close()
    usage = UsageStore(state / USAGE_FILE)
    usage.add_sample("a1", "alice", at(9), 50.0, None)
    usage.close()
    return UsageWatch(state / "journal.sqlite", state / USAGE_FILE, started=STARTED)


def test_counters_grow_by_slices_and_only_when_due(watch: UsageWatch, config: Config) -> None:
    first = watch.refresh(at(10), config)
    # 08:00 to 10:00: alice booked and held 1 h × 2 GPUs, half of it busy; bob nothing yet
    assert first.booked_seconds == {("vision", "alice"): pytest.approx(2 * 3600)}
    assert first.used_seconds == {"vision": pytest.approx(3600)}
    assert watch.refresh(at(10) + timedelta(seconds=30), config) is first  # not due
    second = watch.refresh(at(12), config)
    assert second.booked_seconds == {
        ("vision", "alice"): pytest.approx(3 * 2 * 3600),
        # a login the site does not know is no series of its own
        ("(none)", "(other)"): pytest.approx(3600),
    }
    # a group whose GPUs were never busy has its series, at 0
    assert second.used_seconds == {"vision": pytest.approx(3 * 3600), "(none)": 0}
    # the week so far, by login
    assert second.week is not None
    rows = {row.key: row for row in second.week.rows}
    assert rows["alice"].held == pytest.approx(6.0) and rows["bob"].booked == pytest.approx(1.0)
    # a clock that goes back counts nothing again
    again = watch.refresh(at(11), config)
    assert again.booked_seconds == second.booked_seconds


def test_a_journal_that_cannot_be_read_keeps_the_last_view(
    watch: UsageWatch, config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    before = watch.refresh(at(10), config)
    watch.journal_file.rename(watch.journal_file.with_suffix(".moved"))
    with caplog.at_level(logging.WARNING):
        assert watch.refresh(at(11), config) is before
    assert "usage figures not read" in caplog.text
    # back again: the slice it missed is counted with the next one
    watch.journal_file.with_suffix(".moved").rename(watch.journal_file)
    after = watch.refresh(at(12), config)
    assert after.booked_seconds[("vision", "alice")] == pytest.approx(3 * 2 * 3600)


def test_metrics_and_page_show_the_usage(watch: UsageWatch, config: Config) -> None:
    view = watch.refresh(at(12), config)
    state = replace(build_state(host="gpu1", now=at(12), sessions=()), usage=view)
    text = generate_latest(registry_for(lambda: state)).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    booked = "gpuresa_gpu_seconds_booked_total"
    assert samples[(booked, (("group", "vision"), ("user", "alice")))] == 21600
    assert samples[(booked, (("group", "(none)"), ("user", "(other)")))] == 3600
    assert samples[("gpuresa_gpu_seconds_used_total", (("group", "vision"),))] == 10800
    page = render_page(state, UTC)
    week = page[page.index("<h2>This week</h2>") : page.index("<h2>Rejected bookings</h2>")]
    assert '<td>alice</td><td class="number">6.0</td>' in week
    assert "<td>total</td>" in week
    # before the first read, the page says so and /metrics has no usage counters
    empty = build_state(host="gpu1", now=at(12), sessions=())
    assert "Not read yet." in render_page(empty, UTC)
    assert b"gpuresa_gpu_seconds" not in generate_latest(registry_for(lambda: empty))


@pytest.mark.docker  # the daemon checks its engine and builds the config's images
def test_a_running_daemon_publishes_the_counters_and_the_week(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon's own loop reads its journal: a booking under way (written in the journal
    before the start) shows in /metrics, on the page, and in `gpuresa report`."""
    port = free_port()
    config_file = write_ics_config(tmp_path)
    config_file.write_text(
        config_file.read_text() + f'[telemetry]\nbackend = "none"\nlisten = "127.0.0.1:{port}"\n'
    )
    config = load_config(config_file)
    now = datetime.now(UTC)
    journal = Journal(config.daemon.state_dir / JOURNAL_FILE)
    booking = reservation(
        "under-way", "alice", 2, now - timedelta(hours=1), now + timedelta(hours=1)
    )
    journal.reservations.record([replace(booking, host=config.daemon.host)], [], now)
    journal.close()
    daemon = Daemon(config)
    daemon.start()
    try:

        def booked() -> float:
            text = get(f"http://127.0.0.1:{port}/metrics")
            return sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "gpuresa_gpu_seconds_booked_total"
                and sample.labels.get("user") == "alice"
            )

        wait_for(lambda: booked() > 0, 20, "alice's booked GPU-seconds in /metrics")
        page = get(f"http://127.0.0.1:{port}/")
        week = page[page.index("<h2>This week</h2>") : page.index("<h2>Rejected bookings</h2>")]
        assert "<td>alice</td>" in week
    finally:
        daemon.shutdown()
    assert main(["report", "--config", str(config_file), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["key"] for row in rows] == ["alice"] and rows[0]["booked_gpu_hours"] > 0
