"""The loop's parts: periodic jobs, the table of action kinds, and the loop on a moved clock.

The loop reads one injected clock: these tests move a `ManualClock` to see
what happens (and that nothing more happens) instead of sleeping. The
engine and the calendars are replaced at the gateways' boundary; the loop,
its parts, the executor, the journal and the outbox are the real ones.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_for
from test_plan import CONFIG, T0

from gpuresa.daemon.actions import KINDS, kind_of
from gpuresa.daemon.clock import ManualClock
from gpuresa.daemon.executor import LIFE_CYCLE, NOTICE
from gpuresa.daemon.housekeeping import MAINTENANCE_EVERY, MAINTENANCE_FIRST, OUTPUTS_FIRST
from gpuresa.daemon.loop import Loop
from gpuresa.daemon.periodic import Periodic
from gpuresa.daemon.polling import POLL_DEADLINE
from gpuresa.daemon.state import Context
from gpuresa.journal.guard import open_journal
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Session
from gpuresa.planning import actions as planned

# --- periodic jobs ---------------------------------------------------------------------------


def test_a_periodic_job_is_due_at_its_time_never_twice_at_once() -> None:
    every = [60.0]
    job = Periodic("job", lambda: every[0], next_at=100.0)
    assert not job.due(99.9) and job.due(100.0)
    run = job.begin(100.0)
    assert not job.due(1000.0)  # under way
    assert not job.overran(130.0, 30.0) and job.overran(130.1, 30.0)
    every[0] = 10.0  # a reload changed the interval: the next run follows it
    job.finish(105.0)
    assert job.is_current(run)
    assert not job.due(114.9) and job.due(115.0)
    job.finish(115.0, after=1.0)
    assert job.next_at == 116.0


def test_an_abandoned_run_is_no_longer_current_and_the_job_is_due_again() -> None:
    job = Periodic("poll", lambda: 1.0, next_at=0.0)
    first = job.begin(5.0)
    job.abandon()
    assert job.due(5.0)
    second = job.begin(5.0)
    assert not job.is_current(first) and job.is_current(second)


# --- the table of action kinds ------------------------------------------------------------


def action_classes() -> list[type[planned.Action]]:
    return [
        item
        for _, item in inspect.getmembers(planned, inspect.isclass)
        if issubclass(item, planned.Action) and item is not planned.Action
    ]


def test_every_kind_of_action_the_planner_makes_has_its_row() -> None:
    assert set(action_classes()) == set(KINDS)


@pytest.mark.parametrize("kind", [planned.Stop, planned.Start, planned.Recreate, planned.Prepare])
def test_the_life_cycle_runs_in_its_own_lane_and_backs_off_or_escalates(
    kind: type[planned.Action],
) -> None:
    row = KINDS[kind]
    assert row.lane == LIFE_CYCLE
    assert row.on_failure == ("kill" if kind is planned.Stop else "back-off")


def test_notices_run_beside_the_life_cycle_and_are_only_logged_when_they_fail() -> None:
    for kind in set(action_classes()) - {
        planned.Stop,
        planned.Start,
        planned.Recreate,
        planned.Prepare,
    }:
        assert KINDS[kind].lane == NOTICE and KINDS[kind].on_failure == "log", kind


def test_a_stops_deadline_is_its_grace_and_a_margin() -> None:
    stop = planned.Stop("a", grace=timedelta(minutes=2))
    row = kind_of(stop)
    assert row is not None
    assert row.deadline(stop) == 120 + 60
    start = kind_of(planned.Start("a"))
    assert start is not None and start.deadline(planned.Start("a")) == 120


# --- the loop on a moved clock ------------------------------------------------------------


class EmptyEngine:
    """An engine with no session and four GPUs; counts the collections of leftovers."""

    def __init__(self) -> None:
        self.collections: list[set[str]] = []

    def list_sessions(self) -> list[Any]:
        return []

    def host_gpus(self) -> tuple[int, ...]:
        return (0, 1, 2, 3)

    def cleanup(self, busy: Collection[str]) -> list[str]:
        self.collections.append(set(busy))
        return []


class CountedOutputs:
    """The outputs duty, counted."""

    def __init__(self) -> None:
        self.runs: list[datetime] = []

    def run(self, now: datetime, *rest: Any) -> str:
        self.runs.append(now)
        return "nothing to do"


@dataclasses.dataclass
class Stage:
    loop: Loop
    clock: ManualClock
    engine: EmptyEngine
    outputs: CountedOutputs
    polls: list[datetime]
    release: threading.Event

    def turn(self, seconds: float = 0.0) -> None:
        """Move the clock on `seconds`, let the loop take one turn, run what came back."""
        self.clock.advance(seconds)
        self.loop.turn()
        self.drain()

    def drain(self, quiet: float = 0.2) -> None:
        deadline = time.monotonic() + quiet
        while time.monotonic() < deadline:
            job = self.loop.next_job()
            if job is None:
                time.sleep(0.01)
                continue
            job()
            deadline = time.monotonic() + quiet


@pytest.fixture
def stage(tmp_path: Path) -> Iterator[Stage]:
    config = dataclasses.replace(
        CONFIG, daemon=dataclasses.replace(CONFIG.daemon, state_dir=tmp_path)
    )
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    clock = ManualClock(T0)
    engine = EmptyEngine()
    context = Context(
        config,
        journal,
        Outbox(journal, Notifier(config.notify, config.users)),
        runtime=engine,  # type: ignore[arg-type]
        clock=clock.now,
    )
    outputs = CountedOutputs()
    context.outputs = outputs  # type: ignore[assignment]
    polls: list[datetime] = []
    release = threading.Event()

    def poll(
        now: datetime,
        holding: Mapping[str, tuple[datetime, datetime]],
        holding_gpus: Mapping[str, int] | None = None,
    ) -> Any:
        """A calendar server that answers only once `release` is set (then with an error)."""
        polls.append(now)
        release.wait(30)
        raise RuntimeError("the calendar server closed the connection")

    context.poll = poll  # type: ignore[method-assign]
    yield Stage(Loop(context, clock=clock), clock, engine, outputs, polls, release)
    release.set()
    journal.close()


def test_a_poll_past_its_deadline_is_abandoned_and_its_late_answer_ignored(
    stage: Stage, caplog: pytest.LogCaptureFixture
) -> None:
    stage.turn()
    wait_for(lambda: stage.polls, 5, "the first poll")
    stage.turn(POLL_DEADLINE - 1)
    assert len(stage.polls) == 1  # still waiting for it
    stage.turn(2)
    wait_for(lambda: len(stage.polls) == 2, 5, "a poll after the abandoned one")
    assert stage.polls[1] == T0 + timedelta(seconds=POLL_DEADLINE + 1)
    with caplog.at_level(logging.WARNING):
        stage.release.set()

        def answered() -> bool:
            stage.drain(0.05)
            return not stage.loop.polling.job.running

        wait_for(answered, 5, "the answers")
        stage.drain()
    assert "finished after all; ignored" in caplog.text
    assert stage.loop.counters.errors().get("poll") == 1  # the current one's error, once


def test_maintenance_runs_a_minute_after_the_start_then_hourly(stage: Stage) -> None:
    stage.release.set()  # polls answer at once
    stage.turn()
    stage.turn(OUTPUTS_FIRST)
    wait_for(lambda: stage.outputs.runs, 5, "the first outputs duty")
    stage.drain()
    assert stage.engine.collections == []
    stage.turn(MAINTENANCE_FIRST - OUTPUTS_FIRST)
    wait_for(lambda: stage.engine.collections, 5, "the first maintenance")
    stage.drain()
    # nothing more until an hour later, however often the loop turns
    for _ in range(6):
        stage.turn(MAINTENANCE_EVERY.total_seconds() / 6 - 1)
    assert len(stage.engine.collections) == 1
    stage.turn(6)
    wait_for(lambda: len(stage.engine.collections) == 2, 5, "the second maintenance")
    # the outputs duty ran again meanwhile (every ten minutes)
    assert len(stage.outputs.runs) >= 2


def test_a_session_of_a_new_login_brings_the_outputs_duty_forward(stage: Stage) -> None:
    stage.release.set()
    stage.turn()
    stage.turn(OUTPUTS_FIRST)
    wait_for(lambda: stage.outputs.runs, 5, "the first outputs duty")
    stage.drain()
    # a session of a login the output service does not serve yet: SFTP must work right
    # after its end, not at the next ten-minute round
    session = Session(
        key="k", user="alice", host="gpu1", template="pytorch", cuda=None,
        gpu_count=1, gpu_indices=(0,),
        start=T0, end=T0 + timedelta(hours=1), ssh_port=223, ftp_port=255,
        ftp_passive_first=24000, ftp_passive_last=24002, state="created",
        output_dir=Path("/o/alice/k"),
    )  # fmt: skip
    stage.loop.survey.sessions = [session]
    stage.turn(1)
    wait_for(lambda: len(stage.outputs.runs) == 2, 5, "an outputs duty for alice")
    # once seen, the same login brings nothing forward again
    for _ in range(5):
        stage.turn(1)
    assert len(stage.outputs.runs) == 2
