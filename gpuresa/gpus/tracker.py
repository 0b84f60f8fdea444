"""GPU use per booking, and the findings it leads to, from one snapshot at a time.

`UsageTracker.observe(now, sessions, snapshot, containers)` is called by the
daemon's telemetry worker after each sample. It records each running
session's use in the `UsageStore`, and returns what is new: a booking idle for
too long, a process on a GPU outside the sessions that hold it, a GPU lost
inside a session or from the host. Each finding is returned once (claimed in
the store, so a restarted daemon does not repeat it).

It reads the host's /proc and cgroup files through `HostInspector`, never
anything inside a container.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.gpus import cgroups
from gpuresa.gpus.findings import (
    Finding,
    GpuLostFromHost,
    GpuLostInSession,
    IdleBooking,
    UnbookedProcess,
)
from gpuresa.gpus.readings import GpuReading, GpuSnapshot
from gpuresa.gpus.usage_store import UsageStore
from gpuresa.model import Session

log = logging.getLogger(__name__)

# a GPU must be missing from this many readable snapshots in a row before it
# counts as gone from the host: one failed answer is not a lost GPU
MISSES_BEFORE_LOST = 2


@dataclass(frozen=True)
class IdlePolicy:
    """When a booking counts as idle, and who hears about it."""

    threshold: int = 5
    after: timedelta = timedelta(hours=2)
    action: str = "notify"


@dataclass(frozen=True)
class HostInspector:
    """The host facts the tracker needs, read from /proc, /sys/fs/cgroup and /dev.

    device_pattern names GPU N's device node ("/dev/nvidia{minor}").
    """

    proc: Path = cgroups.PROC
    cgroup_root: Path = cgroups.CGROUP_ROOT
    device_pattern: str = "/dev/nvidia{minor}"

    def container_of(self, pid: int) -> str | None:
        return cgroups.container_of(pid, self.proc)

    def owner(self, pid: int) -> cgroups.ProcessOwner:
        return cgroups.process_owner(pid, self.proc)

    def device_access(self, container_id: str, minors: Sequence[int]) -> bool | None:
        paths = [Path(self.device_pattern.format(minor=minor)) for minor in minors]
        numbers = [cgroups.device_numbers(path) for path in paths]
        if any(number is None for number in numbers):
            # the host has no node for it: that is a GPU lost from the host, not the session
            return None
        return cgroups.device_access(
            container_id, [number for number in numbers if number is not None], self.cgroup_root
        )


@dataclass(frozen=True)
class SessionContainer:
    """One container of a session: its full id, the session's key and its role."""

    id: str
    key: str
    role: str = "main"


@dataclass
class _Idle:
    since: datetime
    samples: int = 0
    total: float = 0.0


@dataclass(frozen=True)
class TrackerView:
    """What the tracker knows now, for status, metrics and the page."""

    idle: frozenset[str] = frozenset()
    unbooked: tuple[UnbookedProcess, ...] = ()
    lost: frozenset[str] = frozenset()


@dataclass
class UsageTracker:
    """Turns snapshots into per-session use and findings; see the module docstring."""

    store: UsageStore
    idle: IdlePolicy = IdlePolicy()
    inspector: HostInspector = HostInspector()
    _idle: dict[str, _Idle] = field(default_factory=dict)
    _misses: dict[str, int] = field(default_factory=dict)
    _view: TrackerView = TrackerView()

    @property
    def view(self) -> TrackerView:
        return self._view

    def observe(
        self,
        now: datetime,
        sessions: Sequence[Session],
        snapshot: GpuSnapshot,
        containers: Sequence[SessionContainer] = (),
    ) -> list[Finding]:
        """Record one sample; return the findings not returned before.

        `sessions` are this host's sessions (any state); `containers` their
        containers with full ids. A snapshot that is not `ok` records nothing
        and concludes nothing.
        """
        present = {session.key for session in sessions}
        ended = [key for key in self.store.uses(running=True) if key not in present]
        if ended:
            self.store.end(ended, now)
            for key in ended:
                self.store.forget_gpus(key)
                self._idle.pop(key, None)
        if not snapshot.ok:
            return []
        running = [session for session in sessions if session.state == "running"]
        bound = self._bind(running, snapshot)
        findings: list[Finding] = []
        lost: set[str] = set()
        for session in running:
            uuids = bound.get(session.key)
            if not uuids:
                continue
            readings = [snapshot.by_uuid(uuid) for uuid in uuids.values()]
            present_readings = [reading for reading in readings if reading is not None]
            self._sample(session, present_readings, now)
            if len(present_readings) == len(readings):
                findings += self._check_idle(session, present_readings, now)
                lost_inside = self._check_access(session, present_readings, containers, now)
                if lost_inside is not None:
                    findings.append(lost_inside)
                    lost.add(session.key)
        findings += self._check_host(running, bound, snapshot, now, lost)
        unbooked = self._unbooked(running, bound, snapshot, containers)
        for process in unbooked:
            if self.store.claim_report("unbooked", f"{process.gpu_uuid}:{process.pid}", now):
                findings.append(process)
        self._view = TrackerView(frozenset(self._idle_keys(now)), tuple(unbooked), frozenset(lost))
        for finding in findings:
            log.info("%s: %s", finding.kind, finding.text())
        return findings

    def _bind(self, running: Sequence[Session], snapshot: GpuSnapshot) -> dict[str, dict[int, str]]:
        """The UUIDs of each running session's GPUs, recorded the first time they are seen."""
        bound = self.store.bound_gpus()
        for session in running:
            if session.key in bound or not session.gpu_indices:
                continue
            readings = {index: snapshot.by_index(index) for index in session.gpu_indices}
            found = {index: r.uuid for index, r in readings.items() if r is not None}
            if len(found) == len(readings):
                self.store.bind_gpus(session.key, found)
                bound[session.key] = found
            else:
                log.warning("%s: GPU(s) %s not on the host at first sight", session.key,
                            sorted(set(session.gpu_indices) - set(found)))  # fmt: skip
        return bound

    def _sample(self, session: Session, readings: Sequence[GpuReading], now: datetime) -> None:
        values = [r.utilization for r in readings if r.utilization is not None]
        memory = [r.memory_used for r in readings if r.memory_used is not None]
        self.store.add_sample(
            session.key,
            session.user,
            now,
            sum(values) / len(values) if values else None,
            float(sum(memory)) if memory else None,
        )

    def _check_idle(
        self, session: Session, readings: Sequence[GpuReading], now: datetime
    ) -> list[Finding]:
        values = [r.utilization for r in readings]
        if any(value is None for value in values):
            return []
        busiest = max(value for value in values if value is not None)
        if busiest >= self.idle.threshold:
            # any GPU above the threshold: the booking is in use
            self._idle.pop(session.key, None)
            return []
        idle = self._idle.setdefault(session.key, _Idle(since=now))
        idle.samples += 1
        idle.total += sum(v for v in values if v is not None) / len(values)
        if now - idle.since < self.idle.after:
            return []
        if not self.store.claim_report("idle", session.key, now):
            return []
        use = self.store.uses().get(session.key)
        return [
            IdleBooking(
                key=session.key,
                user=session.user,
                email=session.email,
                gpus=session.gpu_indices,
                idle_since=idle.since,
                now=now,
                threshold=self.idle.threshold,
                idle_average=idle.total / idle.samples,
                session_average=use.average_utilization if use else None,
                audience="user+admin" if self.idle.action == "notify-admin" else "user",
            )
        ]

    def _idle_keys(self, now: datetime) -> list[str]:
        return [key for key, idle in self._idle.items() if now - idle.since >= self.idle.after]

    def _check_access(
        self,
        session: Session,
        readings: Sequence[GpuReading],
        containers: Sequence[SessionContainer],
        now: datetime,
    ) -> GpuLostInSession | None:
        main = next((c for c in containers if c.key == session.key and c.role == "main"), None)
        minors = [r.minor for r in readings]
        if main is None or any(minor is None for minor in minors):
            return None
        allowed = self.inspector.device_access(main.id, [m for m in minors if m is not None])
        if allowed is not False:
            # True, or None: not knowable here (cgroups v2); never recreate on a guess
            return None
        if not self.store.claim_report("lost-in-session", f"{session.key}:{main.id}", now):
            return None
        return GpuLostInSession(
            session.key, session.user, session.email, session.gpu_indices, main.id
        )

    def _check_host(
        self,
        running: Sequence[Session],
        bound: Mapping[str, Mapping[int, str]],
        snapshot: GpuSnapshot,
        now: datetime,
        lost: set[str],
    ) -> list[Finding]:
        holders: dict[str, tuple[int, list[str]]] = {}
        for session in running:
            for index, uuid in bound.get(session.key, {}).items():
                holders.setdefault(uuid, (index, []))[1].append(session.key)
        findings: list[Finding] = []
        for uuid, (index, keys) in holders.items():
            if snapshot.by_uuid(uuid) is not None:
                self._misses.pop(uuid, None)
                continue
            self._misses[uuid] = self._misses.get(uuid, 0) + 1
            if self._misses[uuid] < MISSES_BEFORE_LOST:
                continue
            lost.update(keys)
            if self.store.claim_report("lost-from-host", f"{uuid}:{','.join(sorted(keys))}", now):
                findings.append(GpuLostFromHost(index, uuid, tuple(sorted(keys))))
        return findings

    def _unbooked(
        self,
        running: Sequence[Session],
        bound: Mapping[str, Mapping[int, str]],
        snapshot: GpuSnapshot,
        containers: Sequence[SessionContainer],
    ) -> list[UnbookedProcess]:
        """Every process on a GPU that is not in a container of a session holding that GPU."""
        holder_of: dict[str, Session] = {}
        for session in running:
            for uuid in bound.get(session.key, {}).values():
                holder_of[uuid] = session
        key_of_container = {container.id: container.key for container in containers}
        found = []
        for gpu in snapshot.gpus:
            holder = holder_of.get(gpu.uuid)
            for process in gpu.processes:
                container_id = self.inspector.container_of(process.pid)
                container_key = key_of_container.get(container_id) if container_id else None
                if holder is not None and container_key == holder.key:
                    continue  # the booking's own work
                owner = self.inspector.owner(process.pid)
                if owner.uid is None:
                    # exited since the sample (or not in our pid namespace): nothing to tell
                    log.debug("GPU %s: process %s is gone", gpu.index, process.pid)
                    continue
                found.append(
                    UnbookedProcess(
                        pid=process.pid,
                        gpu_index=gpu.index,
                        gpu_uuid=gpu.uuid,
                        host_user=owner.user,
                        command=owner.command,
                        used_memory=process.used_memory,
                        container_id=container_id,
                        container_key=container_key,
                        holder_key=holder.key if holder else None,
                        holder_user=holder.user if holder else None,
                    )
                )
        return found
