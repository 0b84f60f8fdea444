"""A session's job: known by the id gpuresa recorded when it submitted it, never by its name.

A job's name is anyone's to choose, and a reservation's name (which the
session's job shares) is shown to every host user by `scontrol show res`: a
job of that name is the session's only when it is the job gpuresa submitted.
The submission is therefore recorded on both sides of `sbatch`:

1. a random token is recorded in the session's record (root's alone), then
2. the job is submitted *held*, as the booking's login, with the token as its
   comment, and its id recorded; then
3. it is released.

A daemon killed between 2 and its record finds its held job again by the
token, the login and the name: nobody else knew the token before that
submission, and the job is held, so nothing of it ran meanwhile. A job with
the recorded id is the session's if its login and name are the record's (an
id comes back only after Slurm's job ids wrap). Any other job of the name is
a stranger's: reported once, never adopted, never cancelled.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from pathlib import Path

from gpuresa.backends.slurm.answering import presented_digest
from gpuresa.backends.slurm.gateway import Job, SlurmGateway
from gpuresa.backends.slurm.records import Record, Records
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)

COMMENT = "gpuresa:"
# a job being ended still holds its processes: a stop waits for it
_ENDING = "COMPLETING"
# past a booking's end and its stop's grace, what a job's time limit leaves gpuresa's stop:
# as long as the daemon lets a stop run past its grace before it kills instead
STOP_MARGIN = timedelta(seconds=60)


def limit_minutes(start: datetime, end: datetime, grace: timedelta = timedelta(0)) -> int:
    """A job time limit, in the whole minutes Slurm counts, that runs from `start` past
    `end` plus `grace` plus `STOP_MARGIN`: Slurm's TIMEOUT (SIGTERM, then SIGKILL after
    `KillWait`) never comes before gpuresa's stop, which gives the session its grace."""
    return max(1, math.ceil((end + grace + STOP_MARGIN - start).total_seconds() / 60))


def submission_comment(token: str) -> str:
    """The comment of the job submitted under `token`."""
    return COMMENT + token


class SessionJobs:
    """The jobs of the sessions in `records`, through one gateway."""

    def __init__(self, gateway: SlurmGateway, records: Records) -> None:
        self.gateway = gateway
        self.records = records
        # (session key, job id) of the strangers' jobs already reported
        self._reported: set[tuple[str, int]] = set()

    @staticmethod
    def _is_live(job: Job) -> bool:
        return job.waits_or_runs or job.state == _ENDING

    def own(self, record: Record, jobs: Sequence[Job] | None = None) -> Job | None:
        """`record`'s job while it waits, runs or is being ended (None: none, or over)."""
        if record.job is None:
            return None
        listed = self.gateway.jobs() if jobs is None else jobs
        for job in listed:
            if job.id == record.job:
                if job.user != record.user or job.name != record.name:
                    # the id came back after Slurm's ids wrapped: the session's job is over
                    return None
                return job if self._is_live(job) else None
        return None

    def left_held(self, record: Record, jobs: Sequence[Job] | None = None) -> Job | None:
        """The held job of a submission whose id was never recorded (a daemon killed right
        after `sbatch`), found by its token, its login and its name; None when there is
        none."""
        if record.job is not None or not record.submission:
            return None
        listed = self.gateway.jobs(record.name) if jobs is None else jobs
        mine = [
            job
            for job in listed
            if job.comment == submission_comment(record.submission)
            and job.user == record.user
            and job.name == record.name
            and self._is_live(job)
        ]
        # the first: a copy made once the comment was shown could only come later
        return min(mine, key=lambda job: job.id) if mine else None

    def submit(self, record: Record, minutes: int, log_file: Path, script: str) -> Record:
        """Submit `record`'s job (as the booking's login, in its reservation, on its node,
        with its GPUs, a limit of `minutes`, its output to `log_file`, running `script`)
        held, record its id, release it; the record with the job. Raises `SessionError`
        when Slurm refuses."""
        record = record.with_submission(secrets.token_hex(16))
        self.records.put(record)
        argv = [
            "sbatch",
            "--parsable",
            "--hold",
            f"--comment={submission_comment(record.submission)}",
            f"--job-name={record.name}",
            f"--reservation={record.name}",
            f"--nodelist={record.node}",
            "--nodes=1",
            "--ntasks=1",
            f"--time={minutes}",
            "--export=NONE",
            f"--output={log_file}",
        ]
        if record.gpus:
            argv.append(f"--gres=gpu:{record.gpus}")
        out = self.gateway.run(argv, as_user=record.user, stdin=script)
        record = record.with_job(int(out.strip().split(";")[0]))
        self.records.put(record)
        log.info("%s: job %d submitted for %s", record.key, record.job, record.user)
        self.release(record)
        return record

    def adopt(self, record: Record, job: Job) -> Record:
        """Record `job` (found by `left_held`) as `record`'s and release it."""
        record = record.with_job(job.id)
        self.records.put(record)
        log.info("%s: job %d of an interrupted submission adopted", record.key, job.id)
        self.release(record)
        return record

    def release(self, record: Record) -> None:
        """Let `record`'s job run (nothing when it is not held)."""
        job = self.own(record)
        if job is not None and job.held:
            self.gateway.run(["scontrol", "release", str(job.id)])

    def cancel(self, record: Record, signal: str) -> None:
        """Send `signal` to every process of `record`'s own job (nothing when it has none)."""
        if record.job is None:
            return
        with contextlib.suppress(SessionError):
            self.gateway.run(["scancel", f"--signal={signal}", "--full", str(record.job)])

    def warn(self, record: Record, signal: str) -> bool:
        """Send `signal` to the batch script of `record`'s own job alone (`scancel --batch`),
        which passes it on to the session's processes (see `jobscript`); whether Slurm took
        it (False: no job, or scancel failed, which is logged)."""
        if record.job is None:
            return False
        try:
            self.gateway.run(["scancel", f"--signal={signal}", "--batch", str(record.job)])
        except SessionError as error:
            log.warning("%s: %s not sent to job %d: %s", record.key, signal, record.job, error)
            return False
        return True

    def wait_running(self, record: Record, deadline: float) -> Job:
        """The session's own job once it runs (before `deadline`, a monotonic instant); a
        `SessionError` saying why when it ends first (another SSH server on its port) or
        does not run in time (then cancelled)."""
        while True:
            job = self.own(record)
            if job is not None and job.state == "RUNNING":
                return job
            if job is None or not job.waits_or_runs:
                # a job whose sshd could not bind its port ends at once: say who holds it
                squatter = presented_digest(record.node, record.ssh_port, timeout=2)
                if squatter is not None:
                    raise SessionError(
                        f"session {record.key}: port {record.ssh_port} on {record.node} is held "
                        f"by another SSH server (host key SHA256:{squatter}): the job cannot "
                        "serve it"
                    )
                raise SessionError(
                    f"the job of {record.key} ended before it ran ({job.state if job else 'gone'})"
                )
            if time.monotonic() > deadline:
                self.cancel(record, "KILL")
                raise SessionError(f"the job of {record.key} did not start in time")
            time.sleep(0.3)

    def report_strangers(self, records: Iterable[Record], jobs: Sequence[Job]) -> list[Job]:
        """The jobs named like a session's that are not its own (logged once each); they
        are left alone."""
        by_name = {record.name: record for record in records}
        found = []
        for job in jobs:
            record = by_name.get(job.name)
            if record is None or job.id == record.job or not self._is_live(job):
                continue
            left = self.left_held(record, [job])
            if left is not None:
                continue
            found.append(job)
            if (record.key, job.id) not in self._reported:
                self._reported.add((record.key, job.id))
                log.warning(
                    "%s: job %d of %s is named like the session's job but is not "
                    "gpuresa's; left alone",
                    record.key,
                    job.id,
                    job.user or "?",
                )
        return found
