"""One GPU sample, taken on its own thread: telemetry, use per booking, findings, job files.

The loop starts `Sampler.sample` every `[telemetry] sample_interval` on a
background thread and gets a `Sample` back; nothing here touches the loop's
state. NVML, nvidia-smi, Docker's listing and the usage store are all called
here, never on the loop. One sample runs at a time (the loop waits for one to
come back before it starts the next), which is what `Telemetry` and
`UsageTracker` need.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpuresa.config.sections import Config
from gpuresa.gpus.findings import Finding
from gpuresa.gpus.readings import GpuSnapshot
from gpuresa.gpus.telemetry import Telemetry
from gpuresa.gpus.tracker import (
    HostInspector,
    IdlePolicy,
    SessionContainer,
    TrackerView,
    UsageTracker,
)
from gpuresa.gpus.usage_store import SessionUse, UsageStore
from gpuresa.model import Session
from gpuresa.observe.jobmap import write_job_mapping
from gpuresa.sessions.protocol import SessionBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """What one sample found, for the loop.

    missing: GPUs that sessions were bound to and that the host no longer
    shows (index -> UUID), as long as they stay missing; the loop leaves them
    out of planning.
    """

    snapshot: GpuSnapshot
    sessions: tuple[Session, ...] = ()
    findings: tuple[Finding, ...] = ()
    view: TrackerView = field(default_factory=TrackerView)
    uses: Mapping[str, SessionUse] = field(default_factory=dict)
    missing: Mapping[int, str] = field(default_factory=dict)


class Sampler:
    """The telemetry gateway, the tracker and its store, used by one thread at a time.

    `telemetry` is the injected gateway (tests replay recorded NVML answers);
    without it one is made from `[telemetry] backend` and made again when a
    reload changes the backend. `inspector` reads the host's /proc, cgroups
    and device nodes (default: this host's).
    """

    def __init__(
        self,
        store: UsageStore,
        telemetry: Telemetry | None = None,
        inspector: HostInspector | None = None,
    ) -> None:
        self.store = store
        self._injected = telemetry
        self._telemetry = telemetry
        self.tracker = UsageTracker(store, inspector=inspector or HostInspector())

    def _gateway(self, config: Config) -> Telemetry:
        if self._injected is not None:
            return self._injected
        wanted = config.telemetry.backend
        if self._telemetry is None or self._telemetry.source != wanted:
            if self._telemetry is not None:
                self._telemetry.close()
            self._telemetry = Telemetry(wanted)
        return self._telemetry

    def sample(self, now: datetime, config: Config, runtime: SessionBackend) -> Sample:
        """Sample the GPUs, record each session's use, return what is new.

        Docker is listed only when the GPUs could be read (a host without GPUs
        costs one failed NVML call). Raises what the runtime raises when
        Docker cannot be listed: concluding without the containers would take
        every session's own processes for strangers'.
        """
        telemetry = config.telemetry
        self.tracker.idle = IdlePolicy(
            telemetry.idle_threshold, telemetry.idle_after, telemetry.idle_action
        )
        snapshot = self._gateway(config).sample(now)
        if not snapshot.ok:
            return Sample(snapshot)
        sessions, roles = runtime.sessions_and_units()
        containers = [SessionContainer(id, key, role) for id, (key, role) in roles.items()]
        findings = self.tracker.observe(now, sessions, snapshot, containers)
        if telemetry.job_mapping_dir is not None:
            try:
                write_job_mapping(
                    telemetry.job_mapping_dir, sessions, (gpu.index for gpu in snapshot.gpus)
                )
            except OSError as error:
                log.error("cannot write dcgm-exporter's job mapping files: %s", error)
        view = self.tracker.view
        missing = {
            index: uuid
            for key, bound in self.store.bound_gpus().items()
            if key in view.lost
            for index, uuid in bound.items()
            if snapshot.by_uuid(uuid) is None
        }
        return Sample(
            snapshot,
            tuple(sessions),
            tuple(findings),
            view,
            self.store.uses(running=True),
            missing,
        )

    def close(self) -> None:
        """Close the store and the gateway; only when no sample is under way."""
        if self._telemetry is not None:
            self._telemetry.close()
        self.store.close()
