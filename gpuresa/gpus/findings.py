"""What watching the GPUs found: idle bookings, unbooked processes, lost GPUs.

Plain values; `UsageTracker.observe` returns each one once. `text()` is the
sentence the daemon mails or logs; it carries no password and no e-mail
address, only logins, keys and figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta


def _gpus(indices: tuple[int, ...]) -> str:
    return ", ".join(str(index) for index in indices) or "none"


def _percent(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0f} %"


def _duration(value: timedelta) -> str:
    minutes = int(value.total_seconds() // 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min"


@dataclass(frozen=True)
class IdleBooking:
    """A running session whose GPUs all stayed under `threshold` percent since `idle_since`.

    audience: "user" (idle_action "notify") or "user+admin" ("notify-admin").
    """

    key: str
    user: str
    email: str | None
    gpus: tuple[int, ...]
    idle_since: datetime
    now: datetime
    threshold: int
    idle_average: float
    session_average: float | None
    audience: str = "user"
    kind: str = "idle"

    def text(self) -> str:
        return (
            f"Your reservation {self.key} holds GPU(s) {_gpus(self.gpus)} but they have been "
            f"idle for {_duration(self.now - self.idle_since)}: average use "
            f"{_percent(self.idle_average)} over that time (threshold {self.threshold} %), "
            f"{_percent(self.session_average)} since the session started. "
            "If you no longer need them, please end your booking so that others can use them."
        )


@dataclass(frozen=True)
class UnbookedProcess:
    """A process on a GPU that is not one of the sessions holding that GPU.

    container_id: its container (None: a host process); container_key: the
    gpuresa session that container belongs to, if any; holder_key/holder_user:
    the session that booked this GPU now (None: an unbooked GPU).
    """

    pid: int
    gpu_index: int
    gpu_uuid: str
    host_user: str
    command: str
    used_memory: int | None
    container_id: str | None
    container_key: str | None
    holder_key: str | None
    holder_user: str | None
    kind: str = "unbooked"

    @property
    def where(self) -> str:
        if self.container_key:
            return f"session {self.container_key}"
        if self.container_id:
            return f"container {self.container_id[:12]}"
        return "the host"

    def text(self) -> str:
        memory = "" if self.used_memory is None else f", {self.used_memory // 2**20} MiB"
        booking = (
            f"booked by {self.holder_user} ({self.holder_key})"
            if self.holder_key
            else "not booked by anyone"
        )
        return (
            f"Process {self.pid} ({self.command}, user {self.host_user}, in {self.where}"
            f"{memory}) runs on GPU {self.gpu_index} ({self.gpu_uuid}), {booking}."
        )


@dataclass(frozen=True)
class GpuLostInSession:
    """The host sees the session's GPUs but its container may no longer open them.

    The daemon recreates the session's containers (output and booking kept)
    and tells the user.
    """

    key: str
    user: str
    email: str | None
    gpus: tuple[int, ...]
    container_id: str
    kind: str = "lost-in-session"

    def text(self) -> str:
        return (
            f"Your session {self.key} lost access to its GPU(s) {_gpus(self.gpus)} "
            "(the host still sees them). Its containers are being recreated; your output "
            "folder and your booking are unchanged. Processes that ran in the session "
            "were stopped: please start them again."
        )


@dataclass(frozen=True)
class GpuLostFromHost:
    """A GPU that sessions hold no longer shows on the host (fell off the bus, driver reset).

    The daemon takes `keys` out of the plan with a notice instead of retrying
    starts that cannot succeed until their bookings end.
    """

    gpu_index: int
    gpu_uuid: str
    keys: tuple[str, ...]
    kind: str = "lost-from-host"

    def text(self) -> str:
        return (
            f"GPU {self.gpu_index} ({self.gpu_uuid}) is no longer visible on the host; "
            f"sessions holding it: {', '.join(self.keys) or 'none'}."
        )


Finding = IdleBooking | UnbookedProcess | GpuLostInSession | GpuLostFromHost
