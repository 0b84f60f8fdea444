"""What gpuresa remembers of each Slurm session: one JSON file per session, root's alone.

Slurm keeps the reservation and the job; this record keeps what Slurm has no
field for (the booking's key, ports, template, output folder, the node gpuresa
chose, when the job started) so that a new backend object, after a restart or
a `kill -9`, rebuilds every session and finds its reservation by name and its
job by the id recorded at its submission.
Files are written whole and renamed into place: a crash leaves the old record
or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.labels import safe_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    """One session of the cluster."""

    key: str
    name: str
    user: str
    host: str
    node: str
    template: str
    cuda: str | None
    gpus: int
    start: datetime
    end: datetime
    ssh_port: int
    email: str | None = None
    output: str = ""
    job: int | None = None
    job_start: datetime | None = None
    # the session's udocker container (`[slurm] container = "udocker"`): its name, recorded
    # before it is made (a name of its own each time, as the removal of an earlier one may
    # still run), and whether its making completed
    container: str = ""
    container_made: bool = False
    # the fingerprint of the host key the job's sshd made, for the start notice
    host_key: str = ""
    # the token of the job's submission, recorded before it (see `jobs.SessionJobs`)
    submission: str = ""

    @classmethod
    def of(cls, spec: SessionSpec, name: str, node: str) -> Record:
        return cls(
            spec.key,
            name,
            spec.user,
            spec.host,
            node,
            spec.template,
            spec.cuda,
            spec.gpu_count,
            spec.start,
            spec.end,
            spec.ssh_port,
            spec.email,
        )

    def with_output(self, output: str) -> Record:
        return dataclasses.replace(self, output=output)

    def with_job(self, job: int) -> Record:
        return dataclasses.replace(self, job=job, job_start=None)

    def with_submission(self, token: str) -> Record:
        return dataclasses.replace(self, submission=token)

    def with_job_start(self, moment: datetime) -> Record:
        return dataclasses.replace(self, job_start=moment)

    def with_container(self, name: str, made: bool) -> Record:
        return dataclasses.replace(self, container=name, container_made=made)

    def with_host_key(self, fingerprint: str) -> Record:
        return dataclasses.replace(self, host_key=fingerprint)

    def with_end(self, end: datetime) -> Record:
        return dataclasses.replace(self, end=end)

    def session(self, state: str, output_dir: Path, *, reserved: bool = True) -> Session:
        """The session this record describes, in `state`; `reserved`: its reservation stands
        (`containers` names it, and the job once there is one)."""
        return Session(
            key=self.key,
            user=self.user,
            host=self.host,
            template=self.template,
            cuda=self.cuda,
            gpu_count=self.gpus,
            # the devices are the node's to choose
            gpu_indices=(),
            start=self.start,
            end=self.end,
            ssh_port=self.ssh_port,
            ftp_port=0,
            ftp_passive_first=0,
            ftp_passive_last=0,
            state=state,
            output_dir=output_dir,
            email=self.email,
            containers=tuple(
                item
                for item in (
                    f"reservation {self.name}" if reserved else "",
                    f"job {self.job}" if self.job else "",
                )
                if item
            ),
            place=self.node,
            host_key=self.host_key,
        )

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for field in ("start", "end", "job_start"):
            data[field] = data[field].isoformat() if data[field] else None
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Record:
        data = json.loads(text)
        for field in ("start", "end", "job_start"):
            data[field] = datetime.fromisoformat(data[field]) if data[field] else None
        return cls(**data)


class Records:
    """The records under `root` (made root's, mode 0700)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / f"{safe_key(key)}.json"

    def get(self, key: str) -> Record | None:
        try:
            return Record.from_json(self._path(key).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def put(self, record: Record) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._path(record.key)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(record.to_json(), encoding="utf-8")
        os.replace(temporary, path)

    def remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def all(self) -> list[Record]:
        found = []
        for path in sorted(self.root.glob("*.json")):
            try:
                found.append(Record.from_json(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError, KeyError) as error:
                log.error("%s: unreadable Slurm session record, left alone: %s", path, error)
        return found
