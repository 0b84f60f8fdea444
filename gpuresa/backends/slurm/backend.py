"""Sessions on a Slurm cluster: each booking a reservation, each session a job.

One gpuresa daemon on the login or controller node serves the cluster (its
`[[hosts]]` entry has `engine = "slurm"`). A session's place is a node, or
`partition:<name>` where gpuresa picks the first node of the partition that
takes jobs and has the GPUs free (see `placement.node_for`). Everything
Slurm holds for session `key` is named `gpuresa-<12 hex digits of the host
and key>`: its reservation and its job; a record in `<state_dir>/slurm/`
(root's) remembers the rest, so a new backend object adopts both and never
touches a reservation it did not make. A job is the session's by the id
recorded when gpuresa submitted it and by its login, never by its name, which
anyone may give a job (see `jobs`).

Reserving GPUs (see `Reserver`): where Slurm reserves GRES (23.11 and later)
the reservation holds `gres/gpu=N` on the node for the whole booking. Slurm
22.05 reserves only nodes or cores, so there the reservation holds the whole
node from the booking's start: the backfill scheduler starts no other job on
it that would run into the booking. At the start the session's job runs in
the reservation with `--gres=gpu:N`; once it runs it holds its GPUs for its
time limit (past the booking's end: see `limit_minutes`), so gpuresa takes the job out of the
reservation and deletes it, handing the node's other GPUs back to the
cluster. A reservation that would overlap another gpuresa reservation of the
same node still waiting for its job is made when that job runs. One that
Slurm refuses ahead (the node busy with jobs that would run into the booking)
is tried again until the start whenever the sessions are listed (the daemon
does it every round; see `Reserver.tend`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path
from signal import Signals

from gpuresa.access import AccessError, check_login, host_account
from gpuresa.backends.slurm.answering import wait_for_job_sshd
from gpuresa.backends.slurm.container import JobContainers
from gpuresa.backends.slurm.gateway import Job, Node, SlurmGateway
from gpuresa.backends.slurm.jobs import SessionJobs, limit_minutes
from gpuresa.backends.slurm.jobscript import PASSED_ON, JobSettings, job_script
from gpuresa.backends.slurm.placement import node_for
from gpuresa.backends.slurm.records import Record, Records
from gpuresa.backends.slurm.reserver import Reserver
from gpuresa.backends.slurm.run_folders import login_in_job_log, make_run_folders
from gpuresa.config.capabilities import SLURM
from gpuresa.config.sections import Config
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.folder import output_path
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import SessionFacts, SessionFiles

log = logging.getLogger(__name__)

PREFIX = "gpuresa-"


def slurm_name(host: str, key: str) -> str:
    """The name of session `key`'s reservation and job on `host`."""
    return PREFIX + hashlib.sha256(f"{host}\0{key}".encode()).hexdigest()[:12]


class SlurmBackend:
    """The sessions of one Slurm cluster (see the module and `backends.protocol`)."""

    # a job's sshd runs as the booking's login, with no root on its node: its port is an
    # unprivileged one, and the job's own host key proves it (see `answering`); the
    # cluster places each job's GPUs on a node of its choosing
    capabilities = SLURM

    def __init__(self, config: Config, gateway: SlurmGateway | None = None) -> None:
        self.config = config
        self.host = config.host()
        settings = config.slurm
        self.gateway = gateway or SlurmGateway(settings.timeout.total_seconds())
        self.records = Records(config.daemon.state_dir / "slurm")
        # the users' sshd reads its session's folder by its path: traversable, not listable;
        # each folder is its login's group's (`_make_folders`): no other user reads its keys
        self.files = SessionFiles(
            settings.shared_dir / "sessions", root_mode=0o711, folder_mode=0o750
        )
        self.runs = settings.shared_dir / "runs"
        self.reserver = Reserver(self.gateway, settings.gres_reservations, PREFIX)
        self.jobs = SessionJobs(self.gateway, self.records)
        # sessions whose prepare runs in this object: their reservation is its to make
        self._preparing: set[str] = set()
        # the template's container in each job (None: the node's own sshd)
        self.containers = JobContainers(config) if settings.container == "udocker" else None

    # --- what the cluster can serve -------------------------------------------------------

    def check(self) -> None:
        if os.geteuid() != 0:
            raise SessionError("only root (or SlurmUser) may make Slurm reservations")
        self.gateway.version()

    def host_gpus(self) -> tuple[int, ...]:
        """GPU indices on one node: a booking holds a count of them on its node."""
        return tuple(range(max((node.gpus for node in self.gateway.nodes().values()), default=0)))

    def node_for(self, spec: SessionSpec) -> Node:
        """The node of `spec`'s place (`placement.node_for`); raises `SessionError`."""
        nodes = self.gateway.nodes()
        return node_for(spec, nodes, self.records.all(), self.config.slurm.partition or "")

    def check_spec(self, spec: SessionSpec) -> None:
        try:
            check_login(spec.user)
        except AccessError as error:
            raise SessionError(str(error)) from None
        if host_account(spec.user) is None:
            raise SessionError(f"{spec.user!r} has no account on the cluster")
        self.node_for(spec)

    def provisioned(self, template: str | None, cuda: str | None) -> bool:
        return self.containers is None or self.containers.provisioned(template, cuda)

    def provision(self, template: str | None, cuda: str | None) -> None:
        """Build and save the template's image for the jobs' containers (minutes); nothing
        without containers (the job runs the node's own sshd)."""
        if self.containers is not None:
            self.containers.provision(template, cuda)

    # --- a session's life -----------------------------------------------------------------

    def prepare(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        self._preparing.add(spec.key)
        try:
            return self._prepare(spec)
        finally:
            self._preparing.discard(spec.key)

    def _prepare(self, spec: SessionSpec) -> Session:
        record = self.records.get(spec.key)
        if record is None:
            self.check_spec(spec)
            node = self.node_for(spec)
            record = Record.of(spec, slurm_name(self.host.name, spec.key), node.name)
            record = record.with_output(str(output_path(self.config, spec)))
            self.records.put(record)
            self._make_folders(record)
        if record.job is None:
            if self.containers is not None and not record.container_made:
                record = self._make_container(record)
            self.reserver.reserve(record, waiting_is_fine=True, own=self._own_jobs())
        return self._session(record, None)

    def _make_container(self, record: Record) -> Record:
        """Make the session's container under a new name, recorded first; one whose making
        was cut off (a daemon killed) is removed in the background."""
        assert self.containers is not None
        self._remove_container(record)
        record = record.with_container(f"{record.name}-{secrets.token_hex(4)}", made=False)
        self.records.put(record)
        self.containers.make(
            record.key, record.user, record.template, record.cuda, record.container
        )
        record = record.with_container(record.container, made=True)
        self.records.put(record)
        return record

    def _remove_container(self, record: Record) -> None:
        if self.containers is not None:
            # a record of an earlier version names none: its container had the job's name
            self.containers.remove(record.key, record.user, record.container or record.name)

    def start(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        self.prepare(spec, ready_timeout)
        record = self.records.get(spec.key)
        assert record is not None
        job = self.jobs.own(record)
        left = None if job is not None else self.jobs.left_held(record)
        # a job submitted by this start (not one that already ran) is cancelled if it fails
        fresh = job is None or job.state != "RUNNING"
        if left is not None:
            # a daemon killed right after the submission: its job, held, is adopted
            record = self.jobs.adopt(record, left)
        elif job is None or not job.waits_or_runs:
            self.reserver.reserve(
                record, waiting_is_fine=False, start_now=True, own=self._own_jobs()
            )
            record = self._submit(record)
        elif job.held:
            # a daemon killed between the job's record and its release
            self.jobs.release(record)
        deadline = time.monotonic() + max(ready_timeout, self.config.slurm.start_timeout.seconds)
        job = self.jobs.wait_running(record, deadline)
        if record.job_start is None:
            # the time limit counts from the job's start (Slurm's): an extension is measured
            # from it, so that the new limit never ends before the booking
            record = record.with_job_start(job.start or datetime.now(UTC))
            self.records.put(record)
        account = host_account(record.user)
        if account is None:
            raise SessionError(f"{record.user!r} has no account on the cluster")
        public = self.runs / record.name / "host_key.pub"
        # the job's sshd, by the host key the job made: its fingerprint is for the notice
        try:
            found = wait_for_job_sshd(
                record.key, record.node, record.ssh_port, public, account.uid, deadline
            )
        except SessionError:
            if fresh:
                self.jobs.cancel(record, "KILL")
            raise
        self.reserver.hand_over(record, job)
        for other in self.records.all():
            if other.node == record.node and other.key != record.key and other.job is None:
                with contextlib.suppress(SessionError):
                    self.reserver.reserve(other, waiting_is_fine=True, own=self._own_jobs())
        record = record.with_host_key(found)
        self.records.put(record)
        # node reservations are gone once handed over; GRES reservations stand to the end
        return self._session(record, job, reserved=self.reserver.gres_mode())

    def _own_jobs(self) -> set[int]:
        """The ids of the jobs gpuresa submitted for its sessions."""
        return {record.job for record in self.records.all() if record.job is not None}

    def _submit(self, record: Record) -> Record:
        # whole minutes, rounded up from now: the limit counts from the job's start, which
        # is now or later, so the job never ends before the booking and its stop's grace
        # (gpuresa stops it then)
        minutes = limit_minutes(datetime.now(UTC), record.end, self.config.daemon.stop_grace)
        settings = JobSettings(
            record.user,
            record.ssh_port,
            self.host.bind_address,
            self.files.path(record.key),
            self.runs / record.name,
            Path(record.output),
            container=None
            if self.containers is None
            else self.containers.job_settings(
                record.key,
                record.user,
                record.template,
                record.cuda,
                record.container or record.name,
                self.files.path(record.key),
                Path(record.output),
            ),
        )
        log_file = self.runs / record.name / "job.log"
        return self.jobs.submit(record, minutes, log_file, job_script(settings))

    def stop(self, key: str, grace: timedelta) -> None:
        record = self.records.get(key)
        if record is None:
            return
        if self.jobs.own(record) is not None:
            self.jobs.cancel(record, "TERM")
            limit = time.monotonic() + grace.total_seconds()
            while self.jobs.own(record) is not None and time.monotonic() < limit:
                time.sleep(0.2)
        self.kill(key)

    def kill(self, key: str) -> None:
        record = self.records.get(key)
        if record is None:
            return
        left = self.jobs.left_held(record)
        if left is not None:
            # the held job of a submission cut off before its record: ended with the rest
            record = record.with_job(left.id)
        limit = time.monotonic() + 20
        while self.jobs.own(record) is not None:
            self.jobs.cancel(record, "KILL")
            if time.monotonic() > limit:
                raise SessionError(f"the job of {key} does not end")
            time.sleep(0.3)
        self.reserver.release(record)
        self._remove_container(record)
        self.files.remove(key)
        shutil.rmtree(self.runs / record.name, ignore_errors=True)
        self.records.remove(key)
        self.reserver.forget(key)
        log.info("%s: stopped; its output goes to %s", key, record.output)
        self.finish_stop(record.session("stopped", Path(record.output)))

    def reset(self, key: str) -> None:
        """Nothing to remake: Slurm grants a job's GPUs itself, for the job's whole life."""
        log.warning("%s: a session on Slurm is not made again for lost GPUs", key)

    def finish_stop(self, session: Session) -> None:
        # the output already belongs to the login: its retention is recorded
        from gpuresa.outputs.handover import finish_output

        finish_output(self.config, session)

    def sessions_and_units(self) -> tuple[list[Session], dict[str, tuple[str, str]]]:
        """`list_sessions()`; the GPU tracker matches no cgroup of Slurm's jobs yet."""
        return self.list_sessions(), {}

    # --- what runs --------------------------------------------------------------------------

    def list_sessions(self) -> list[Session]:
        """Every session of the records, with its own job; jobs named like one that are
        not its own are reported, and reservations refused ahead tried again
        (`Reserver.tend`)."""
        records = self.records.all()
        if not records:
            return []
        jobs = self.gateway.jobs(PREFIX)
        self.jobs.report_strangers(records, jobs)
        standing = set(self.gateway.reservations())
        self.reserver.tend(records, standing, self._preparing)
        return [
            self._session(record, self.jobs.own(record, jobs), record.name in standing)
            for record in records
        ]

    def _session(self, record: Record, job: Job | None, reserved: bool = True) -> Session:
        """The session of `record`: its state from `job`; `reserved`: its reservation stands."""
        if job is not None and job.state == "RUNNING":
            state = "running"
        elif job is None and record.job is not None:
            state = "stopped"
        else:
            state = "created"
        return record.session(state, Path(record.output), reserved=reserved)

    def message(self, key: str, text: str) -> None:
        self.files.show_message(key, text, datetime.now(UTC))

    def used(self, key: str) -> bool | None:
        """The protocol's `used`: the job's log, where its sshd writes (`jobscript`)."""
        record = self.records.get(key)
        return None if record is None else login_in_job_log(self.runs, record)

    def signal(self, key: str, number: Signals) -> int:
        """`number` to the batch script of the session's own running job, which passes it on
        to the session's processes but its sshd and container (`jobscript`). Slurm does not
        say how many got it: 1 when it took the signal, else 0 (no such session, its job
        waits or is over, a signal the script does not pass on: it would end the job)."""
        record = self.records.get(key)
        job = None if record is None else self.jobs.own(record)
        if record is None or job is None or job.state != "RUNNING":
            return 0
        if number not in PASSED_ON:
            log.warning("%s: %s is not passed on by a session's job; not sent", key, number.name)
            return 0
        if not self.jobs.warn(record, number.name.removeprefix("SIG")):
            return 0
        log.info("%s: %s sent to job %d", key, number.name, job.id)
        return 1

    def extend(self, key: str, end: datetime) -> None:
        record = self.records.get(key)
        if record is None:
            raise SessionError(f"no session {key}")
        record = record.with_end(end)
        self.records.put(record)
        self.reserver.extend(record)
        job = self.jobs.own(record)
        began = (job.start if job else None) or record.job_start
        if job is not None and began is not None:
            minutes = limit_minutes(began, end, self.config.daemon.stop_grace)
            self.gateway.scontrol("update", "", {"JobId": str(job.id), "TimeLimit": str(minutes)})
        self._show(record)

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        record = self.records.get(session.key)
        output = Path(record.output) if record else Path("/")
        return SessionFacts(
            session.user,
            session.template,
            session.cuda,
            session.gpu_count,
            session.gpu_indices,
            session.end,
            output,
        )

    def cleanup(self, busy: Collection[str]) -> list[str]:
        """Nothing: a session's reservation, job and folders go with its stop.

        A reservation named like gpuresa's without a record is not removed
        either: it may be another gpuresa's, or an admin's copy.
        """
        return []

    # --- files ----------------------------------------------------------------------------

    def _make_folders(self, record: Record) -> None:
        make_run_folders(self.config, self.files, self.runs, record)
        self._show(record)

    def _show(self, record: Record) -> None:
        session = record.session("created", Path(record.output))
        self.files.show_facts(record.key, self.facts(session), self.config.reservations.timezone)
