"""The loop's side of GPU telemetry and observation: samples, findings, the published state.

A part of `loop.Loop`, kept apart for size: it runs on the loop thread only.
Every `[telemetry] sample_interval` a sample is taken off the loop
(`sampling.Sampler`); what comes back is turned into notices (idle bookings,
unbooked processes), a recreation (a session whose container lost its GPUs),
or GPUs left out of planning (gone from the host). After each round and each
sample the loop publishes an `ObservedState` that `/metrics` and the status
page read.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from gpuresa.config.sections import Config, HostConfig
from gpuresa.daemon.executor import LIFE_CYCLE, Executor
from gpuresa.daemon.sampling import Sample, Sampler
from gpuresa.daemon.state import Context
from gpuresa.daemon.work import Done
from gpuresa.gpus.findings import (
    Finding,
    GpuLostFromHost,
    GpuLostInSession,
    IdleBooking,
    UnbookedProcess,
)
from gpuresa.gpus.readings import GpuSnapshot
from gpuresa.model import Rejection, Reservation, Session
from gpuresa.observe.state import CalendarView, Counters, Published, build_state
from gpuresa.planning.planner import Action, Inventory, Prepare, Recreate, Start
from gpuresa.reservations.calendars import CalendarReport

log = logging.getLogger(__name__)


def planning_inventory(host: HostConfig, gpus: Iterable[int], lost: Iterable[int]) -> Inventory:
    """The inventory to plan with: the host's GPUs but those gone from it."""
    gone = set(lost)
    return Inventory(host, tuple(index for index in gpus if index not in gone))


def held_back(actions: Sequence[Action], lost: Iterable[int]) -> tuple[list[Action], list[str]]:
    """`actions` without the starts that would need a GPU gone from the host.

    A session that holds such a GPU cannot be started or made again until it
    comes back: it keeps its booking instead of failing and retrying until the
    booking ends. Returns the actions to carry out and the keys held back.
    """
    gone = set(lost)
    kept, held = [], []
    for action in actions:
        spec = getattr(action, "spec", None)
        if isinstance(action, (Start, Recreate, Prepare)) and spec and gone & set(spec.gpus):
            held.append(action.key)
        else:
            kept.append(action)
    return kept, held


def relevant_rejections(config: Config, rejections: Iterable[Rejection]) -> list[Rejection]:
    """The rejections of calendars this host reads for itself or for every host."""
    mine = {item.name for item in config.calendars if item.host in (None, config.daemon.host)}
    return [rejection for rejection in rejections if rejection.calendar in mine]


class Observing:
    """GPU samples and the published state; mixed into `Loop`."""

    context: Context
    executor: Executor
    sessions: list[Session]
    gpus: tuple[int, ...]
    reservations: list[Reservation]
    sampler: Sampler | None
    published: Published
    counters: Counters

    if TYPE_CHECKING:  # `Rounds` and `Loop` have them

        def _changed(self) -> None: ...

        def _background(
            self, name: str, work: Callable[[], object], done: Callable[[object], None]
        ) -> None: ...

    def _init_observing(self, sampler: Sampler | None) -> None:
        self.sampler = sampler
        self.published = Published(build_state(host=self.context.config.daemon.host,
                                               now=self.context.clock(), sessions=()))  # fmt: skip
        self.counters = Counters()
        self.lost_gpus: dict[int, str] = {}
        self._sampling = False
        self._next_sample = time.monotonic()
        self._sample: Sample | None = None
        self._calendar_report: CalendarReport | None = None
        self._held_back: set[str] = set()
        self._recreated: set[str] = set()
        self._lost_inside: dict[str, GpuLostInSession] = {}

    # --- sampling -------------------------------------------------------------------------

    @property
    def sampling(self) -> bool:
        """Whether a sample is under way (its thread uses the sampler)."""
        return self._sampling

    def _sample_if_due(self, monotonic: float) -> None:
        if self._lost_inside:
            self._recreate_lost()
        telemetry = self.context.config.telemetry
        if self.sampler is None or telemetry.backend == "none":
            return
        if self._sampling or monotonic < self._next_sample:
            return
        self._sampling = True
        sampler, context = self.sampler, self.context
        now = context.clock()
        self._background(
            "sample", lambda: sampler.sample(now, context.config, context.runtime), self._sampled
        )

    def _sampled(self, result: object) -> None:
        self._sampling = False
        interval = self.context.config.telemetry.sample_interval.total_seconds()
        self._next_sample = time.monotonic() + interval
        if not isinstance(result, Sample):
            log.error("sampling the GPUs failed: %s", result)
            self.counters.count_error("telemetry")
            return
        self._sample = result
        if result.snapshot.ok:
            self._track_missing(result)
        for finding in result.findings:
            self._found(finding)
        self._publish()

    def _track_missing(self, sample: Sample) -> None:
        """GPUs gone from the host leave planning; one that shows again comes back."""
        back = [index for index, uuid in self.lost_gpus.items() if sample.snapshot.by_uuid(uuid)]
        for index in back:
            log.warning("GPU %s (%s) is visible again; planning with it", index,
                        self.lost_gpus.pop(index))  # fmt: skip
        for index, uuid in sample.missing.items():
            if index not in self.lost_gpus:
                log.error("GPU %s (%s) is gone from the host; left out of planning", index, uuid)
                self.lost_gpus[index] = uuid
        if back or sample.missing:
            self._changed()

    # --- findings -------------------------------------------------------------------------

    def _found(self, finding: Finding) -> None:
        notices = self.context.notices
        telemetry = self.context.config.telemetry
        if isinstance(finding, IdleBooking):
            notices.idle(finding)
        elif isinstance(finding, UnbookedProcess):
            if telemetry.report_unbooked:
                notices.unbooked(finding)
        elif isinstance(finding, GpuLostInSession):
            # once per session: containers made anew that still cannot open their GPUs
            # would otherwise be killed again at every sample
            if telemetry.recreate_lost and finding.key not in self._recreated:
                self._lost_inside[finding.key] = finding
                self._recreate_lost()
            else:
                notices.lost_in_session(finding, recreated=False)
        elif isinstance(finding, GpuLostFromHost):
            self.lost_gpus.setdefault(finding.gpu_index, finding.gpu_uuid)
            holders = [session for session in self.sessions if session.key in finding.keys]
            notices.lost_from_host(finding, holders)
            self._changed()

    def _recreate_lost(self) -> None:
        """End the main container of each session that lost its GPUs, on the executor.

        The next round's `Recreate` makes it again. A session whose life cycle
        is busy (its start still under way) waits for a later turn; one that
        no longer runs is dropped.
        """
        work = self.context.work
        running = {session.key for session in self.sessions if session.state == "running"}
        for key, finding in list(self._lost_inside.items()):
            if self.executor.busy(key, LIFE_CYCLE):
                continue
            del self._lost_inside[key]
            if key not in running:
                log.info("%s: lost its GPUs but no longer runs; nothing to recreate", key)
                continue
            self.executor.submit(
                key,
                "recreate",
                functools.partial(work.end_main, key),
                functools.partial(self._main_ended, key),
                60,
                lane=LIFE_CYCLE,
            )
            self._recreated.add(key)
            self.context.notices.lost_in_session(finding, recreated=True)

    def _main_ended(self, key: str, outcome: object) -> None:
        now = self.context.clock()
        what = "end the main container (GPUs lost inside the session)"
        if isinstance(outcome, Done):
            self.context.journal.record_action(key, what, now, "ok")
        else:
            log.error("%s: ending the main container failed: %s", key, outcome)
            self.context.journal.record_action(key, what, now, "failed", str(outcome))
            self.counters.count_error("recreate")
        self._changed()

    # --- planning around lost GPUs --------------------------------------------------------

    def _inventory(self, gpus: tuple[int, ...]) -> Inventory:
        return planning_inventory(self.context.config.host(), gpus, self.lost_gpus)

    def _without_lost(self, actions: list[Action]) -> list[Action]:
        kept, held = held_back(actions, self.lost_gpus)
        for key in set(held) - self._held_back:
            log.warning("%s: not started: it holds a GPU gone from the host", key)
        self._held_back = set(held)
        return kept

    # --- the published state --------------------------------------------------------------

    def _polled_report(self, report: CalendarReport) -> None:
        self._calendar_report = report

    def _publish(self) -> None:
        """Swap in a new picture for `/metrics` and the page (only what the loop holds)."""
        context = self.context
        config = context.config
        now = context.clock()
        sample = self._sample
        report = self._calendar_report
        snapshot = sample.snapshot if sample else None
        if config.telemetry.backend == "none":
            snapshot = GpuSnapshot(now, "none")
        freshness = report.freshness if report else {}
        state = build_state(
            host=config.daemon.host,
            now=now,
            sessions=self.sessions,
            reservations=self.reservations,
            rejections=relevant_rejections(config, report.reservations.rejected if report else ()),
            calendars=[
                CalendarView(name, item.last_success, item.last_error)
                for name, item in freshness.items()
            ],
            snapshot=snapshot,
            uses=sample.uses if sample else None,
            view=sample.view if sample else None,
            host_gpus=tuple(self._inventory(self.gpus).gpus),
            counters=self.counters,
            outbox_backlog=context.outbox.backlog(),
        )
        self.published.publish(state)
