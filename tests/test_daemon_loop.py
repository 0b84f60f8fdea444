"""The loop against the gateways' boundary: what it plans with while actions are under way.

Docker is replaced by a runtime and actions that report what they were asked
(the gateway's boundary); the loop, the executor, the planner, the journal
and the outbox are the real ones.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from test_plan import CONFIG, T0, booking, running

from gpuresa.daemon.clock import ManualClock
from gpuresa.daemon.loop import Loop
from gpuresa.daemon.state import Context
from gpuresa.daemon.work import Done, Started
from gpuresa.journal.guard import open_journal
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.planning.actions import Prepare, Recreate, Start


class RecordingWork:
    """Actions that record what they were asked and succeed; a start waits for `release`."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, tuple[int, ...], int]] = []
        self.release = threading.Event()

    def start(self, action: Start | Recreate, before: Any, now: Any) -> Started:
        assert action.spec is not None
        self.starts.append((action.key, action.spec.gpu_indices, action.spec.ssh_port))
        self.release.wait(5)
        return Started(running(booking(action.key), action.spec.gpu_indices, action.spec.ssh_port))

    def prepare(self, action: Prepare, now: Any) -> Done:
        return Done()


def drain(loop: Loop, quiet: float = 0.5) -> None:
    """Run the jobs posted to the loop until none comes for `quiet` seconds."""
    deadline = time.monotonic() + quiet
    while time.monotonic() < deadline:
        job = loop.next_job()
        if job is None:
            time.sleep(0.01)
            continue
        job()
        deadline = time.monotonic() + quiet


def test_a_look_at_docker_from_before_a_start_ended_is_not_planned_with(tmp_path: Path) -> None:
    config = dataclasses.replace(
        CONFIG, daemon=dataclasses.replace(CONFIG.daemon, state_dir=tmp_path)
    )
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    clock = ManualClock(T0 + timedelta(seconds=1))
    context = Context(
        config,
        journal,
        Outbox(journal, Notifier(config.notify, config.users)),
        runtime=object(),  # type: ignore[arg-type]
        clock=clock.now,
    )
    work = RecordingWork()
    context.work = work  # type: ignore[assignment]
    loop = Loop(context, clock=clock)
    first, second = booking("k"), booking("a")  # the same slot; "a" sorts first
    loop.polling.reservations = [first, second]
    loop.remembered.retry_after["a"] = T0 + timedelta(seconds=10)  # a's last try failed
    gpus = (0, 1, 2, 3)
    # a survey begins, then k's start is dispatched and ends before the survey returns
    stale_survey = loop.survey.generation
    loop.survey.surveyed(([], gpus), loop.survey.generation)
    assert [item[0] for item in work.starts] == ["k"]
    work.release.set()
    drain(loop)
    clock.advance(10)  # a may be tried again
    loop.survey.surveyed(([], gpus), stale_survey)
    drain(loop)
    # neither k again nor a on k's GPU and port: the old survey was not planned with
    assert [item[0] for item in work.starts] == ["k"]
    assert loop.survey.wanted
    journal.close()
