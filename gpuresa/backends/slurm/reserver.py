"""A booking's reservation: made ahead, kept in line with the booking, handed to its job.

Two ways to hold a booking's GPUs, chosen by the installed Slurm (or `[slurm]
gres_reservations`):

- GRES reservations (Slurm 23.11 and later): `TRES=gres/gpu=N` on the node;
  the reservation stands for the whole booking and the job runs in it.
- Node reservations (Slurm 22.05 cannot reserve GRES): the whole node from
  the booking's start, so that nothing else is started on it that would run
  into the booking; once the session's job runs and holds its GPUs, the job
  is taken out of the reservation and the reservation deleted (`hand_over`),
  which gives the node's other GPUs back to the cluster. Never `IGNORE_JOBS`
  over another user's job: that could leave the booking fewer GPUs than it
  booked; only over gpuresa's own sessions' jobs (known by their recorded ids,
  never by their names), whose GPUs are counted.

Only jobs that wait or run count: squeue still lists ended jobs for a while.
A reservation refused ahead of the start (the node busy, or held for an
earlier booking) is tried again until the start (`tend`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from datetime import UTC, datetime

from gpuresa.backends.slurm.gateway import Job, SlurmGateway, slurm_time_text
from gpuresa.backends.slurm.records import Record
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

GRES_RESERVATIONS_SINCE = (23, 11)
# seconds between tries of a reservation refused ahead of the start
RETRY_EVERY = 30.0


class Reserver:
    """The reservations of gpuresa's sessions, through one gateway."""

    def __init__(self, gateway: SlurmGateway, gres: str, prefix: str) -> None:
        self.gateway = gateway
        self.gres = gres
        # reservation names are only the controller's admins' to choose: by its prefix a
        # reservation is gpuresa's or the site's
        self.prefix = prefix
        # when each refused reservation is tried again (monotonic seconds), and its last
        # refusal (logged when it changes)
        self._next_try: dict[str, float] = {}
        self._refusals: dict[str, str] = {}
        self.retry_every = RETRY_EVERY

    def gres_mode(self) -> bool:
        """Whether reservations hold GPUs themselves (else whole nodes, handed over)."""
        if self.gres == "auto":
            return self.gateway.version() >= GRES_RESERVATIONS_SINCE
        return self.gres == "yes"

    def reserve(
        self,
        record: Record,
        *,
        waiting_is_fine: bool,
        start_now: bool = False,
        own: Collection[int] = (),
    ) -> bool:
        """Make (or bring in line) `record`'s reservation; whether it stands now.

        `waiting_is_fine`: when another gpuresa reservation of the node, still
        waiting for its job, overlaps, or others' jobs run into the booking,
        return False (tried again: `tend`); otherwise raise `SessionError`.
        `start_now`: the reservation starts now. `own`: the ids of gpuresa's
        sessions' jobs. Raises `SessionError` when the node is the site's (its
        reservation, or another user's job running into the booking).
        """
        now = datetime.now(UTC).replace(microsecond=0)
        start = now if start_now or record.start <= now else record.start
        existing = self.gateway.reservations().get(record.name)
        if existing is not None:
            changes = {}
            if start < existing.start:
                changes["StartTime"] = slurm_time_text(start)
            if abs((existing.end - record.end).total_seconds()) >= 1:
                changes["EndTime"] = slurm_time_text(record.end)
            if changes:
                self.gateway.scontrol("update", "", {"ReservationName": record.name, **changes})
            return True
        settings = {
            "ReservationName": record.name,
            "Users": record.user,
            "StartTime": slurm_time_text(start),
            "EndTime": slurm_time_text(record.end),
            "Nodes": record.node,
        }
        if self.gres_mode():
            settings["TRES"] = f"gres/gpu={record.gpus}"
        try:
            self.gateway.scontrol("create", "reservation", settings)
            log.info("%s: reservation %s on %s made", record.key, record.name, record.node)
            return True
        except SessionError as error:
            text = str(error)
            if "overlaps with another reservation" in text:
                return self._overlapping(record, start, waiting_is_fine)
            if "Duplicate reservation name" in text:
                # made meanwhile by another call of the daemon (a start, a retry)
                return True
            if "busy" not in text:
                raise
        # jobs run into the booking: gpuresa's own (counted) may be ignored, nobody else's
        jobs = [
            job
            for job in self.gateway.jobs()
            if job.waits_or_runs and record.node in job.node.split(",")
        ]
        strangers = [job for job in jobs if job.id not in own]
        if strangers:
            if waiting_is_fine:
                ids = ", ".join(str(job.id) for job in strangers)
                self._refused(record, f"node {record.node} is busy with other jobs ({ids})")
                return False
            ids = ", ".join(str(job.id) for job in strangers)
            raise SessionError(
                f"node {record.node}: other jobs ({ids}) run into the booking; "
                "it cannot hold its GPUs"
            )
        self.gateway.scontrol("create", "reservation", {**settings, "Flags": "IGNORE_JOBS"})
        log.info(
            "%s: reservation %s on %s made beside gpuresa's jobs",
            record.key,
            record.name,
            record.node,
        )
        return True

    def _overlapping(self, record: Record, start: datetime, waiting_is_fine: bool) -> bool:
        others = [
            item
            for item in self.gateway.reservations().values()
            if record.node in item.nodes and item.start < record.end and start < item.end
        ]
        site = [item.name for item in others if not item.name.startswith(self.prefix)]
        if site:
            raise SessionError(f"node {record.node} is reserved by the site ({', '.join(site)})")
        if waiting_is_fine:
            self._refused(record, "the reservation waits for the node's earlier session")
            return False
        names = ", ".join(item.name for item in others)
        raise SessionError(f"node {record.node} is still held for another booking ({names})")

    def _refused(self, record: Record, reason: str) -> None:
        """Note why `record`'s reservation waits (logged when it changes)."""
        if self._refusals.get(record.key) != reason:
            self._refusals[record.key] = reason
            log.info("%s: %s; tried again until the start", record.key, reason)

    def tend(self, records: Iterable[Record], standing: set[str], busy: Collection[str]) -> None:
        """Try again, at most every `retry_every` seconds and only before the start, the
        reservations of prepared sessions (not those in `busy`, being prepared) that are
        not in `standing`; adds those made to it."""
        records = list(records)
        now, clock = datetime.now(UTC), time.monotonic()
        own = {record.job for record in records if record.job is not None}
        for record in records:
            if (
                record.job is not None
                or record.name in standing
                or record.key in busy
                or now >= record.start
                or self._next_try.get(record.key, 0.0) > clock
            ):
                continue
            self._next_try[record.key] = clock + self.retry_every
            try:
                made = self.reserve(record, waiting_is_fine=True, own=own)
            except SessionError as error:
                self._refused(record, f"reservation refused: {error}")
                continue
            if made:
                standing.add(record.name)
                if self._refusals.pop(record.key, None) is not None:
                    log.info("%s: reservation %s made, at a later try", record.key, record.name)

    def forget(self, key: str) -> None:
        """Drop what is known of session `key`'s tries (it is gone)."""
        self._next_try.pop(key, None)
        self._refusals.pop(key, None)

    def hand_over(self, record: Record, job: Job) -> None:
        """Node reservations: the running job keeps its GPUs, the node goes back."""
        if self.gres_mode():
            return
        if job.reservation == record.name:
            self.gateway.scontrol("update", "", {"JobId": str(job.id), "ReservationName": ""})
        self.release(record)

    def release(self, record: Record) -> None:
        """Delete the reservation (nothing when it is gone)."""
        if record.name in self.gateway.reservations():
            self.gateway.scontrol("delete", "", {"ReservationName": record.name})
            log.info("%s: reservation %s deleted", record.key, record.name)

    def extend(self, record: Record) -> None:
        """A standing reservation follows the booking's end."""
        if record.name in self.gateway.reservations():
            self.gateway.scontrol(
                "update",
                "",
                {"ReservationName": record.name, "EndTime": slurm_time_text(record.end)},
            )
