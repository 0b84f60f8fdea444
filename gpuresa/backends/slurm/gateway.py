"""The one gateway to Slurm: every scontrol/sbatch/squeue/scancel call, with a deadline.

A controller that does not answer must delay nothing else: each command runs
with `[slurm] timeout` and is killed past it (`EngineTimeout`); a missing
command or a controller that refuses the connection is `RuntimeUnavailable`;
any other refusal is a `SessionError` carrying Slurm's own message. Every call
is logged with its duration. Output is read from `squeue --json` and from
`scontrol --oneliner` (22.05 has no `scontrol --json`), whose `Key=Value`
fields are parsed here and nowhere else.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from gpuresa.sessions.errors import EngineTimeout, RuntimeUnavailable, SessionError

log = logging.getLogger(__name__)

# what Slurm says when its controller cannot be reached at all
_UNREACHABLE = re.compile(r"Unable to contact slurm controller|Connection refused|Zero Bytes")
# one `Key=Value` field of `scontrol --oneliner`; values run to the next ` Key=`
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z:/_]*)=(.*?)(?=\s+[A-Za-z][A-Za-z:/_]*=|\s*$)")


# States and flags of `scontrol show node` under which a node runs no new job. Not here:
# the power-saving ones (POWERED_DOWN, POWERING_DOWN, POWER_DOWN), since Slurm wakes a
# sleeping node for the job it is given, and REBOOT_ISSUED/REQUESTED, a node that comes back.
UNUSABLE_STATES = frozenset(
    {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "INVALID",
     "INVALID_REG", "NOT_RESPONDING", "UNKNOWN"}
)  # fmt: skip
# power saving: the node sleeps, or is going to; a job given it waits for it to wake
ASLEEP_STATES = frozenset({"POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN"})


@dataclass(frozen=True)
class Node:
    """A node as the controller shows it."""

    name: str
    gpus: int
    state: str
    partitions: tuple[str, ...]

    @property
    def runs_jobs(self) -> bool:
        """Whether a job given this node would run: it answers, is up, and takes work (not
        down, drained, failed, not yet or wrongly registered, or not responding; a node
        powered down to save power counts, as Slurm powers it up for the job)."""
        return not UNUSABLE_STATES.intersection(self.state.split("+"))

    @property
    def asleep(self) -> bool:
        """Whether the node is powered down (or going) to save power: a job waits for it."""
        return bool(ASLEEP_STATES.intersection(self.state.split("+")))


@dataclass(frozen=True)
class Reservation:
    """A reservation as the controller shows it (times in UTC)."""

    name: str
    nodes: str
    users: str
    start: datetime
    end: datetime
    flags: str
    tres: str


# job states of a job that waits or runs; the others that squeue shows (COMPLETED,
# CANCELLED, TIMEOUT, FAILED…, listed for `MinJobAge` after the end) are over, but for
# COMPLETING, a job whose processes are being ended
RUNNING_STATES = frozenset({"RUNNING"})
WAITING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"})


@dataclass(frozen=True)
class Job:
    """A job as `squeue --json` shows it."""

    id: int
    name: str
    user: str
    state: str
    node: str
    reservation: str
    gres: str
    end: datetime | None
    # when it began running (None while it waits): its time limit counts from here
    start: datetime | None = None
    # the submitter's `--comment` (any user chooses their own)
    comment: str = ""
    # why it waits (`JobHeldUser` for a job submitted with `--hold`)
    reason: str = ""

    @property
    def waits_or_runs(self) -> bool:
        """Whether the job waits or runs (not over, nor being ended)."""
        return self.state in RUNNING_STATES | WAITING_STATES

    @property
    def held(self) -> bool:
        """Whether the job waits for a release (`--hold`, `scontrol hold`)."""
        return self.state == "PENDING" and self.reason.startswith("JobHeld")


def fields(line: str) -> dict[str, str]:
    """The `Key=Value` fields of one `scontrol --oneliner` line."""
    return {match.group(1): match.group(2).strip() for match in _FIELD.finditer(line)}


def slurm_time(text: str) -> datetime:
    """A time as scontrol prints it (`2025-03-10T14:00:00`, read in UTC: see `SlurmGateway`)."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)


def slurm_time_text(moment: datetime) -> str:
    """A time as scontrol takes it, in UTC (the gateway runs every command with TZ=UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def gpu_count(gres: str) -> int:
    """The GPUs of a `Gres=`/`tres_per_node` text (`gpu:4`, `gres:gpu:2`, `gpu:a100:2(S:0)`)."""
    total = 0
    for part in gres.split(","):
        names = part.split("(")[0].split(":")
        if "gpu" in names and names[-1].isdigit():
            total += int(names[-1])
    return total


class SlurmGateway:
    """Runs Slurm's commands with a deadline and reads their output.

    Given the deadline of each call in seconds. Every command runs with
    `TZ=UTC`, so times given to and read from Slurm are UTC whatever the
    controller's zone.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._version: tuple[int, int] | None = None

    def run(
        self, argv: Sequence[str], *, as_user: str | None = None, stdin: str | None = None
    ) -> str:
        """The standard output of `argv` (run as `as_user` through runuser when given).

        Raises `EngineTimeout` past the deadline, `RuntimeUnavailable` when the
        command or the controller is missing, `SessionError` with Slurm's message
        when it refuses.
        """
        command = list(argv)
        if as_user is not None:
            command = ["runuser", "-u", as_user, "--", *command]
        began = time.monotonic()
        try:
            done = subprocess.run(
                command,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                env={"TZ": "UTC", "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
                cwd="/",
                check=False,
            )
        except subprocess.TimeoutExpired:
            log.warning("slurm: %s did not answer in %.0f s", " ".join(command), self.timeout)
            raise EngineTimeout(
                f"Slurm did not answer {argv[0]} within {self.timeout:.0f} s"
            ) from None
        except FileNotFoundError:
            raise RuntimeUnavailable(f"{command[0]} is not installed here") from None
        took = time.monotonic() - began
        log.debug("slurm: %s -> %d in %.3f s", " ".join(command), done.returncode, took)
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip().splitlines()
            text = message[-1] if message else f"exit status {done.returncode}"
            if _UNREACHABLE.search(done.stderr):
                raise RuntimeUnavailable(f"the Slurm controller does not answer: {text}")
            raise SessionError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''}: {text}".strip())
        return done.stdout

    # --- reading --------------------------------------------------------------------------

    def version(self) -> tuple[int, int]:
        """The installed Slurm's (major, minor) release, e.g. (22, 5)."""
        if self._version is None:
            found = re.search(r"(\d+)\.(\d+)", self.run(["sinfo", "--version"]))
            if found is None:
                raise RuntimeUnavailable("sinfo --version printed no version")
            self._version = (int(found.group(1)), int(found.group(2)))
        return self._version

    def nodes(self) -> dict[str, Node]:
        """Every node, by name."""
        found = {}
        for line in self.run(["scontrol", "--oneliner", "show", "node"]).splitlines():
            item = fields(line)
            if "NodeName" not in item:
                continue
            partitions = tuple(name for name in item.get("Partitions", "").split(",") if name)
            found[item["NodeName"]] = Node(
                item["NodeName"], gpu_count(item.get("Gres", "")), item.get("State", ""), partitions
            )
        return found

    def reservations(self) -> dict[str, Reservation]:
        """Every reservation, by name."""
        text = self.run(["scontrol", "--oneliner", "show", "reservation"])
        found = {}
        for line in text.splitlines():
            item = fields(line)
            if "ReservationName" not in item:
                continue
            found[item["ReservationName"]] = Reservation(
                item["ReservationName"],
                item.get("Nodes", ""),
                item.get("Users", ""),
                slurm_time(item["StartTime"]),
                slurm_time(item["EndTime"]),
                item.get("Flags", ""),
                item.get("TRES", ""),
            )
        return found

    def jobs(self, prefix: str = "") -> list[Job]:
        """The jobs the controller still lists whose name starts with `prefix`: those that
        wait or run, and, for a while (`MinJobAge`), those that ended (see `Job.state`)."""
        data = json.loads(self.run(["squeue", "--json"]))
        found = []
        for job in data.get("jobs", []):
            name = str(job.get("name", ""))
            if not name.startswith(prefix):
                continue
            end = job.get("end_time")
            began = job.get("start_time") if job.get("job_state") != "PENDING" else None
            found.append(
                Job(
                    int(job["job_id"]),
                    name,
                    str(job.get("user_name", "")),
                    str(job.get("job_state", "")),
                    str(job.get("nodes", "")),
                    str(job.get("resv_name", "") or ""),
                    str(job.get("tres_per_node", "") or ""),
                    datetime.fromtimestamp(int(end), UTC) if end else None,
                    datetime.fromtimestamp(int(began), UTC) if began else None,
                    str(job.get("comment", "") or ""),
                    str(job.get("state_reason", "") or ""),
                )
            )
        return found

    # --- changing -------------------------------------------------------------------------

    def scontrol(self, verb: str, what: str, settings: Mapping[str, str]) -> str:
        """`scontrol <verb> <what> Key=Value …`: create, update or delete."""
        words = [f"{key}={value}" for key, value in settings.items()]
        return self.run(["scontrol", verb, what, *words] if what else ["scontrol", verb, *words])
