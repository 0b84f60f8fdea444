"""The picture of the daemon that `/metrics` and the status page read, swapped in whole.

After each round and each GPU sample the loop builds an `ObservedState` from
what its parts hold and publishes it; the HTTP server reads the current one
and never touches the loop's state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from gpuresa.config.capabilities import host_capabilities
from gpuresa.daemon.observing import GpuWatch, relevant_rejections
from gpuresa.daemon.polling import Polling
from gpuresa.daemon.survey import Survey
from gpuresa.daemon.tools import Tools
from gpuresa.gpus.readings import GpuSnapshot
from gpuresa.gpus.usage_store import USAGE_FILE
from gpuresa.observe.state import CalendarView, Published, build_state
from gpuresa.reports.live import UsageWatch
from gpuresa.reports.reading import JOURNAL_FILE

log = logging.getLogger(__name__)


class Publisher:
    """Builds and swaps in the published state; `gpu_watch()` gives the GPU part."""

    def __init__(
        self, tools: Tools, survey: Survey, polling: Polling, gpu_watch: Callable[[], GpuWatch]
    ) -> None:
        self.tools = tools
        self.survey = survey
        self.polling = polling
        self.gpu_watch = gpu_watch
        self.published = Published(
            build_state(host=tools.context.config.daemon.host, now=tools.clock.now(), sessions=())
        )
        # the week's usage and the GPU-seconds counters, read once a minute
        state_dir = tools.context.config.daemon.state_dir
        self.usage = UsageWatch(
            state_dir / JOURNAL_FILE, state_dir / USAGE_FILE, started=tools.clock.now()
        )
        self.usage_running = False

    def publish(self) -> None:
        """Swap in a new picture (only what the loop holds)."""
        context = self.tools.context
        config = context.config
        now = self.tools.clock.now()
        watch = self.gpu_watch()
        sample = watch.sample
        report = self.polling.report
        snapshot = sample.snapshot if sample else None
        if config.telemetry.backend == "none":
            snapshot = GpuSnapshot(now, "none")
        freshness = report.freshness if report else {}
        state = build_state(
            host=config.daemon.host,
            now=now,
            sessions=self.survey.sessions,
            reservations=self.polling.reservations,
            rejections=relevant_rejections(config, report.reservations.rejected if report else ()),
            calendars=[
                CalendarView(name, item.last_success, item.last_error)
                for name, item in freshness.items()
            ],
            snapshot=snapshot,
            uses=sample.uses if sample else None,
            view=sample.view if sample else None,
            host_gpus=tuple(watch.inventory(self.survey.gpus).gpus),
            counters=self.tools.counters,
            outbox_backlog=context.outbox.backlog(),
            # a scheduler places the GPUs: what is free is a count over time
            places_gpus=host_capabilities(config.host()).places_gpus,
        )
        if self.usage.due(now) and not self.usage_running:
            # read off the loop: the journal, and groups from a directory that may hang
            self.usage_running = True
            self.tools.background(
                "usage", lambda: self.usage.refresh(now, config), self._usage_read
            )
        self.published.publish(replace(state, usage=self.usage.view))

    def _usage_read(self, result: object) -> None:
        self.usage_running = False
        if isinstance(result, Exception):
            log.warning("usage figures not read: %s", result)
