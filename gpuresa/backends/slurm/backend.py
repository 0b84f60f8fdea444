"""Sessions on a Slurm cluster: each booking a reservation, each session a job.

One gpuresa daemon on the login or controller node serves the cluster (its
`[[hosts]]` entry has `engine = "slurm"`). A session's place is a node, or
`partition:<name>` where gpuresa picks the first node of the partition that
takes jobs and has the GPUs free (see `placement.node_for`). Everything
Slurm holds for session `key` is named `gpuresa-<12 hex digits of the host
and key>`: its reservation and its job; a record in `<state_dir>/slurm/`
(root's) remembers the rest, so a new backend object adopts both and never
touches a reservation it did not make.

Reserving GPUs (see `Reserver`): where Slurm reserves GRES (23.11 and later)
the reservation holds `gres/gpu=N` on the node for the whole booking. Slurm
22.05 reserves only nodes or cores, so there the reservation holds the whole
node from the booking's start: the backfill scheduler starts no other job on
it that would run into the booking. At the start the session's job runs in
the reservation with `--gres=gpu:N`; once it runs it holds its GPUs for its
time limit (the booking's end), so gpuresa takes the job out of the
reservation and deletes it, handing the node's other GPUs back to the
cluster. A reservation that would overlap another gpuresa reservation of the
same node still waiting for its job is made when that job runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import secrets
import shutil
import socket
import time
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuresa.access import AccessError, authorized_keys, check_login, host_account
from gpuresa.backends.host_keys import fingerprint_in
from gpuresa.backends.slurm.container import JobContainers
from gpuresa.backends.slurm.gateway import Job, Node, SlurmGateway
from gpuresa.backends.slurm.jobscript import JobSettings, job_script
from gpuresa.backends.slurm.placement import node_for
from gpuresa.backends.slurm.records import Record, Records
from gpuresa.backends.slurm.reserver import Reserver
from gpuresa.config.sections import Config
from gpuresa.model import Session, SessionSpec
from gpuresa.runtime.errors import SessionError
from gpuresa.runtime.output import output_path
from gpuresa.runtime.session_files import SessionFacts, SessionFiles

log = logging.getLogger(__name__)

PREFIX = "gpuresa-"
_RUNNING = {"RUNNING"}
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"}


def limit_minutes(start: datetime, end: datetime) -> int:
    """A job time limit, in the whole minutes Slurm counts, that runs from `start` to no
    earlier than `end` (at least one)."""
    return max(1, math.ceil((end - start).total_seconds() / 60))


def slurm_name(host: str, key: str) -> str:
    """The name of session `key`'s reservation and job on `host`."""
    return PREFIX + hashlib.sha256(f"{host}\0{key}".encode()).hexdigest()[:12]


class SlurmBackend:
    """The sessions of one Slurm cluster (see the module and `backends.protocol`)."""

    def __init__(self, config: Config, gateway: SlurmGateway | None = None) -> None:
        self.config = config
        self.host = config.host()
        settings = config.slurm
        self.gateway = gateway or SlurmGateway(settings.timeout.total_seconds())
        self.records = Records(config.daemon.state_dir / "slurm")
        # the users' sshd reads its session's folder by its path: traversable, not listable
        self.files = SessionFiles(settings.shared_dir / "sessions", root_mode=0o711)
        self.runs = settings.shared_dir / "runs"
        self.reserver = Reserver(self.gateway, settings.gres_reservations, PREFIX)
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
            self.reserver.reserve(record, waiting_is_fine=True)
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
        job = self._job(record)
        if job is None or job.state not in _RUNNING | _WAITING:
            self.reserver.reserve(record, waiting_is_fine=False, start_now=True)
            job_id = self._submit(record)
            record = record.with_job(job_id)
            self.records.put(record)
        deadline = time.monotonic() + max(ready_timeout, self.config.slurm.start_timeout.seconds)
        job = self._wait_running(record, deadline)
        if record.job_start is None:
            # the time limit counts from the job's start (Slurm's): an extension is measured
            # from it, so that the new limit never ends before the booking
            record = record.with_job_start(job.start or datetime.now(UTC))
            self.records.put(record)
        self._wait_ssh(record, deadline)
        self.reserver.hand_over(record, job)
        for other in self.records.all():
            if other.node == record.node and other.key != record.key and other.job is None:
                with contextlib.suppress(SessionError):
                    self.reserver.reserve(other, waiting_is_fine=True)
        # the host key the job made, for the start notice (made before its sshd answered)
        account = host_account(record.user)
        public = self.runs / record.name / "host_key.pub"
        found = None if account is None else fingerprint_in(public, account.uid)
        record = record.with_host_key(found or "")
        self.records.put(record)
        # node reservations are gone once handed over; GRES reservations stand to the end
        return self._session(record, job, reserved=self.reserver.gres_mode())

    def _submit(self, record: Record) -> int:
        # whole minutes, rounded up from now: the limit counts from the job's start, which
        # is now or later, so the job never ends before the booking (gpuresa stops it then)
        minutes = limit_minutes(datetime.now(UTC), record.end)
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={record.name}",
            f"--reservation={record.name}",
            f"--nodelist={record.node}",
            "--nodes=1",
            "--ntasks=1",
            f"--time={minutes}",
            "--export=NONE",
            f"--output={self.runs / record.name / 'job.log'}",
        ]
        if record.gpus:
            argv.append(f"--gres=gpu:{record.gpus}")
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
        out = self.gateway.run(argv, as_user=record.user, stdin=job_script(settings))
        return int(out.strip().split(";")[0])

    def _wait_running(self, record: Record, deadline: float) -> Job:
        while True:
            job = self._job(record)
            if job is not None and job.state in _RUNNING:
                return job
            if job is None or job.state not in _WAITING:
                raise SessionError(
                    f"the job of {record.key} ended before it ran ({job.state if job else 'gone'})"
                )
            if time.monotonic() > deadline:
                self._cancel(record, "KILL")
                raise SessionError(f"the job of {record.key} did not start in time")
            time.sleep(0.3)

    def _wait_ssh(self, record: Record, deadline: float) -> None:
        while True:
            try:
                with socket.create_connection((record.node, record.ssh_port), timeout=2) as link:
                    if link.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SessionError(f"the SSH server of {record.key} did not answer in time")
            time.sleep(0.2)

    def stop(self, key: str, grace: timedelta) -> None:
        record = self.records.get(key)
        if record is None:
            return
        if self._job(record) is not None:
            self._cancel(record, "TERM")
            limit = time.monotonic() + grace.total_seconds()
            while self._job(record) is not None and time.monotonic() < limit:
                time.sleep(0.2)
        self.kill(key)

    def kill(self, key: str) -> None:
        record = self.records.get(key)
        if record is None:
            return
        limit = time.monotonic() + 20
        while self._job(record) is not None:
            self._cancel(record, "KILL")
            if time.monotonic() > limit:
                raise SessionError(f"the job of {key} does not end")
            time.sleep(0.3)
        self.reserver.release(record)
        self._remove_container(record)
        self.files.remove(key)
        shutil.rmtree(self.runs / record.name, ignore_errors=True)
        self.records.remove(key)
        log.info("%s: stopped; output kept in %s", key, record.output)
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

    def _cancel(self, record: Record, signal: str) -> None:
        with contextlib.suppress(SessionError):
            self.gateway.run(["scancel", f"--signal={signal}", "--full", f"--name={record.name}"])

    # --- what runs --------------------------------------------------------------------------

    def _job(self, record: Record) -> Job | None:
        jobs = [job for job in self.gateway.jobs(record.name) if job.name == record.name]
        live = [job for job in jobs if job.state in _RUNNING | _WAITING | {"COMPLETING"}]
        return live[0] if live else None

    def list_sessions(self) -> list[Session]:
        records = self.records.all()
        if not records:
            return []
        jobs = {job.name: job for job in self.gateway.jobs(PREFIX)}
        standing = set(self.gateway.reservations())
        return [
            self._session(record, jobs.get(record.name), record.name in standing)
            for record in records
        ]

    def _session(self, record: Record, job: Job | None, reserved: bool = True) -> Session:
        """The session of `record`: its state from `job`; `reserved`: its reservation stands."""
        if job is not None and job.state in _RUNNING:
            state = "running"
        elif job is None and record.job is not None:
            state = "stopped"
        else:
            state = "created"
        return record.session(state, Path(record.output), reserved=reserved)

    def message(self, key: str, text: str) -> None:
        self.files.show_message(key, text, datetime.now(UTC))

    def extend(self, key: str, end: datetime) -> None:
        record = self.records.get(key)
        if record is None:
            raise SessionError(f"no session {key}")
        record = record.with_end(end)
        self.records.put(record)
        self.reserver.extend(record)
        job = self._job(record)
        began = (job.start if job else None) or record.job_start
        if job is not None and began is not None:
            minutes = limit_minutes(began, end)
            self.gateway.scontrol("update", "", {"JobId": str(job.id), "TimeLimit": str(minutes)})
        self._show(record)

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        record = self.records.get(session.key)
        output = Path(record.output) if record else Path("/")
        return SessionFacts(
            session.user, session.template, session.cuda, session.gpus, session.end, output
        )

    def cleanup(self, busy: Collection[str]) -> list[str]:
        """Nothing: a session's reservation, job and folders go with its stop.

        A reservation named like gpuresa's without a record is not removed
        either: it may be another gpuresa's, or an admin's copy.
        """
        return []

    # --- files ----------------------------------------------------------------------------

    def _make_folders(self, record: Record) -> None:
        account = host_account(record.user)
        if account is None:
            raise SessionError(f"{record.user!r} has no account on the cluster")
        try:
            keys = authorized_keys(record.user, self.config.users)
        except AccessError as error:
            raise SessionError(str(error)) from None
        self.files.show_file(record.key, "authorized_keys", keys)
        self._show(record)
        output = Path(record.output)
        owner_dir = self.config.storage.output_root / record.user
        owner_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        os.chown(owner_dir, 0, account.gid)
        output.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(output, account.uid, account.gid)
        run = self.runs / record.name
        self.runs.mkdir(mode=0o755, parents=True, exist_ok=True)
        run.mkdir(mode=0o700, exist_ok=True)
        os.chown(run, account.uid, account.gid)

    def _show(self, record: Record) -> None:
        session = record.session("created", Path(record.output))
        self.files.show_facts(record.key, self.facts(session), self.config.reservations.timezone)
