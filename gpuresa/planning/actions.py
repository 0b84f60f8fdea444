"""The actions the planner returns and the daemon carries out, one class per kind.

Each is a frozen record naming the reservation's occurrence key and what the
step needs; `order` sorts them so that stops free GPUs and ports before starts
take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuresa.model import SessionSpec


@dataclass(frozen=True)
class Action:
    """One step for the daemon to carry out; `key` is the reservation's occurrence key."""

    key: str

    # lower runs first: stops free GPUs and ports before starts take them
    order = 50

    def describe(self) -> str:
        return f"{type(self).__name__.lower()} {self.key}"


@dataclass(frozen=True)
class Stop(Action):
    """Stop and remove the session; the output folder is kept."""

    reason: str = "ended"
    grace: timedelta = timedelta(seconds=30)
    order = 10

    def describe(self) -> str:
        return f"stop {self.key} ({self.reason})"


@dataclass(frozen=True)
class Fail(Action):
    """The reservation cannot be served (no free GPUs or ports); report it once."""

    reason: str = ""
    user: str = ""
    email: str | None = None
    order = 20

    def describe(self) -> str:
        return f"fail {self.key}: {self.reason}"


@dataclass(frozen=True)
class Recreate(Action):
    """The session's containers exited before its end: remove and start them again."""

    spec: SessionSpec | None = None
    order = 30


@dataclass(frozen=True)
class Start(Action):
    """Start the session (preparing it first when that was not done)."""

    spec: SessionSpec | None = None
    order = 40

    def describe(self) -> str:
        assert self.spec is not None
        return (
            f"start {self.key} for {self.spec.user} (GPUs {list(self.spec.gpu_indices)}, "
            f"ssh {self.spec.ssh_port}, ftp {self.spec.ftp_port})"
        )


@dataclass(frozen=True)
class Prepare(Action):
    """Make the session ready to start: image, output folder, containers created."""

    spec: SessionSpec | None = None
    order = 45


@dataclass(frozen=True)
class Extend(Action):
    """The reservation's end changed while its session exists."""

    end: datetime = datetime.min
    order = 60

    def describe(self) -> str:
        return f"extend {self.key} to {self.end.isoformat()}"


@dataclass(frozen=True)
class Warn(Action):
    """Tell the user the session ends soon; `before` is the warning threshold."""

    before: timedelta = timedelta(0)
    end: datetime = datetime.min
    order = 70

    def describe(self) -> str:
        return f"warn {self.key} ({int(self.before.total_seconds() // 60)} min before the end)"


@dataclass(frozen=True)
class NotifyPreempt(Action):
    """Tell a preemptible session it must give its GPUs up at `stop_at`: in the session,
    by e-mail, and with a signal to its processes."""

    stop_at: datetime = datetime.min
    order = 75

    def describe(self) -> str:
        return f"tell {self.key} it is preempted at {self.stop_at.isoformat()}"


@dataclass(frozen=True)
class NotifyRelease(Action):
    """Tell a session nobody logged into that it is released at `release_at` unless its
    user logs in before (`gpuresa.planning.release`)."""

    release_at: datetime = datetime.min
    order = 76

    def describe(self) -> str:
        return f"tell {self.key} it is released at {self.release_at.isoformat()} unless used"


@dataclass(frozen=True)
class NotifyCancel(Action):
    """Tell the user their booking is gone and when the session will stop."""

    stop_at: datetime = datetime.min
    order = 80


@dataclass(frozen=True)
class NotifyChange(Action):
    """Tell the user a change to their running booking is not applied to the session.

    `change` names what changed ("template pytorch → tensorflow", "GPUs 1 → 2"):
    a running session keeps the template and GPUs it started with, since
    changing them means new containers and the user's processes would be lost.
    """

    change: str = ""
    user: str = ""
    email: str | None = None
    order = 85

    def describe(self) -> str:
        return f"tell {self.key}'s user the change is not applied: {self.change}"
