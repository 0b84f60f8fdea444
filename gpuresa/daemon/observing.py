"""The loop's side of GPU telemetry: samples, findings, GPUs left out of planning.

A part of the loop that runs on the loop thread only. Every `[telemetry]
sample_interval` a sample is taken off the loop (`sampling.Sampler`); what
comes back is turned into notices (idle bookings, unbooked processes), a
recreation (a session whose container lost its GPUs), or GPUs left out of
planning (gone from the host).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence

from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import Config, HostConfig
from gpuresa.daemon.executor import LIFE_CYCLE
from gpuresa.daemon.periodic import Periodic
from gpuresa.daemon.sampling import Sample, Sampler
from gpuresa.daemon.tools import Tools
from gpuresa.daemon.work import Done
from gpuresa.gpus.findings import (
    Finding,
    GpuLostFromHost,
    GpuLostInSession,
    IdleBooking,
    UnbookedProcess,
)
from gpuresa.model import Rejection, Session
from gpuresa.planning.actions import Action, Prepare, Recreate, Start
from gpuresa.planning.facts import Inventory

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
        if isinstance(action, (Start, Recreate, Prepare)) and spec and gone & set(spec.gpu_indices):
            held.append(action.key)
        else:
            kept.append(action)
    return kept, held


def relevant_rejections(config: Config, rejections: Iterable[Rejection]) -> list[Rejection]:
    """The rejections of calendars this host reads for itself or for every host."""
    mine = {item.name for item in config.calendars if item.host in (None, config.daemon.host)}
    return [rejection for rejection in rejections if rejection.calendar in mine]


class GpuWatch:
    """GPU samples and what follows from them: notices, recreations, GPUs left out.

    `sampler`: None for no GPU telemetry at all. `sessions()`: the sessions
    last seen. `changed()`: the engine or the GPUs changed (plan again with a
    fresh survey). `publish()`: a new picture for `/metrics` and the page.
    """

    def __init__(
        self,
        tools: Tools,
        sampler: Sampler | None,
        sessions: Callable[[], list[Session]],
        changed: Callable[[], None],
        publish: Callable[[], None],
    ) -> None:
        self.tools = tools
        self.sampler = sampler
        self.sessions = sessions
        self.changed = changed
        self.publish = publish
        self.job = Periodic(
            "sample",
            lambda: tools.context.config.telemetry.sample_interval.total_seconds(),
            tools.clock.monotonic(),
        )
        self.sample: Sample | None = None
        self.lost_gpus: dict[int, str] = {}
        self._held_back: set[str] = set()
        self._recreated: set[str] = set()
        self._lost_inside: dict[str, GpuLostInSession] = {}

    # --- sampling -------------------------------------------------------------------------

    @property
    def sampling(self) -> bool:
        """Whether a sample is under way (its thread uses the sampler)."""
        return self.job.running

    def tick(self, now: float) -> None:
        """At monotonic `now`: recreations still owed, then a sample if one is due."""
        if self._lost_inside:
            self._recreate_lost()
        config = self.tools.context.config
        if self.sampler is None or config.telemetry.backend == "none":
            return
        if host_capabilities(config.host()).remote_nodes:
            # telemetry reads this machine's GPUs, and a cluster's sessions run on its nodes:
            # matched against them, the login node's GPUs would pass for the sessions'
            return
        if not self.job.due(now):
            return
        self.job.begin(now)
        sampler, context = self.sampler, self.tools.context
        wall = self.tools.clock.now()
        self.tools.background(
            "sample", lambda: sampler.sample(wall, context.config, context.runtime), self._sampled
        )

    def _sampled(self, result: object) -> None:
        self.job.finish(self.tools.clock.monotonic())
        if not isinstance(result, Sample):
            log.error("sampling the GPUs failed: %s", result)
            self.tools.counters.count_error("telemetry")
            return
        self.sample = result
        if result.snapshot.ok:
            self._track_missing(result)
        for finding in result.findings:
            self._found(finding)
        self.publish()

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
            self.changed()

    # --- findings -------------------------------------------------------------------------

    def _found(self, finding: Finding) -> None:
        notices = self.tools.context.notices
        telemetry = self.tools.context.config.telemetry
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
            holders = [session for session in self.sessions() if session.key in finding.keys]
            notices.lost_from_host(finding, holders)
            self.changed()

    def _recreate_lost(self) -> None:
        """End the main container of each session that lost its GPUs, on the executor.

        The next round's `Recreate` makes it again. A session whose life cycle
        is busy (its start still under way) waits for a later turn; one that
        no longer runs is dropped.
        """
        context, executor = self.tools.context, self.tools.executor
        work = context.work
        running = {session.key for session in self.sessions() if session.state == "running"}
        for key, finding in list(self._lost_inside.items()):
            if executor.busy(key, LIFE_CYCLE):
                continue
            del self._lost_inside[key]
            if key not in running:
                log.info("%s: lost its GPUs but no longer runs; nothing to recreate", key)
                continue
            executor.submit(
                key,
                "recreate",
                functools.partial(work.end_main, key),
                functools.partial(self._main_ended, key),
                60,
                lane=LIFE_CYCLE,
            )
            self._recreated.add(key)
            context.notices.lost_in_session(finding, recreated=True)

    def _main_ended(self, key: str, outcome: object) -> None:
        context = self.tools.context
        now = self.tools.clock.now()
        what = "end the main container (GPUs lost inside the session)"
        if isinstance(outcome, Done):
            context.journal.history.record_action(key, what, now, "ok")
        else:
            log.error("%s: ending the main container failed: %s", key, outcome)
            context.journal.history.record_action(key, what, now, "failed", str(outcome))
            self.tools.counters.count_error("recreate")
        self.changed()

    # --- planning around lost GPUs --------------------------------------------------------

    def inventory(self, gpus: tuple[int, ...]) -> Inventory:
        """The inventory to plan with, given the GPUs the engine reports."""
        return planning_inventory(self.tools.context.config.host(), gpus, self.lost_gpus)

    def without_lost(self, actions: list[Action]) -> list[Action]:
        """`actions` but the starts that need a GPU gone from the host (logged once)."""
        kept, held = held_back(actions, self.lost_gpus)
        for key in set(held) - self._held_back:
            log.warning("%s: not started: it holds a GPU gone from the host", key)
        self._held_back = set(held)
        return kept
