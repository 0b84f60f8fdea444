"""Whether this host's process ids can hold every session at its `pids` limit: a warning.

Each session may have `limits.pids` processes and threads (its FTP server a few
more), and every one of them takes a process id of the host's: the kernel
gives at most kernel.pid_max ids and kernel.threads-max tasks to everyone
together. When the sessions that fit the host's port ranges (and GPUs: a
booking takes at least one) may together ask for more, one session that forks
up to its limit leaves the others, sshd and gpuresa itself unable to fork:
the limit protects nobody. Valid config that will not work as meant, so a
warning (like `port_safety`), printed by `gpuresa config validate` and logged
when the daemon starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuresa.config.sections import Config, HostConfig
from gpuresa.errors import UserError

PID_MAX = Path("/proc/sys/kernel/pid_max")
THREADS_MAX = Path("/proc/sys/kernel/threads-max")
# what a session's FTP sidecar may have besides (`runtime.create_payloads.FTP_PIDS_LIMIT`,
# kept equal by a test; not imported: the runtime imports the config package)
FTP_SIDECAR_PIDS = 128
# a value of kernel.pid_max that holds any realistic count of sessions (the 64-bit maximum)
PID_MAX_LIMIT = 4194304


@dataclass(frozen=True)
class KernelLimits:
    """The host's kernel.pid_max and kernel.threads-max (None: unreadable)."""

    pid_max: int | None
    threads_max: int | None

    @classmethod
    def read(cls, pid_max: Path = PID_MAX, threads_max: Path = THREADS_MAX) -> KernelLimits:
        return cls(_number(pid_max), _number(threads_max))


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def session_capacity(host: HostConfig) -> int:
    """How many sessions the host's port ranges (and listed GPUs) let run at once."""
    blocks = len(host.ftp_passive_ports) // host.ftp_passive_per_session
    capacity = min(len(host.ssh_ports), len(host.ftp_ports), blocks)
    if isinstance(host.gpus, tuple) and host.gpus and host.gpu_mode != "none":
        capacity = min(capacity, len(host.gpus))
    return capacity


def processes_per_session(host: HostConfig, pids: int) -> int | None:
    """The host process ids one session may take; None for sessions run on other machines."""
    if host.engine == "slurm":
        return None  # the cluster's nodes run them, each with its own kernel limits
    if host.engine in ("docker", "podman"):
        return pids + FTP_SIDECAR_PIDS
    return pids  # udocker: one cgroup for everything the session runs


def pids_warnings(config: Config, kernel: KernelLimits | None = None) -> list[str]:
    """One warning when the daemon's host's sessions together may take more process ids
    than this machine's kernel gives (`kernel`: read from /proc when None); else none."""
    try:
        host = config.host()
    except UserError:
        return []
    index = config.hosts.index(host)
    pids = config.limits.pids
    per_session = processes_per_session(host, pids)
    kernel = KernelLimits.read() if kernel is None else kernel
    limits = {
        name: value
        for name, value in (("pid_max", kernel.pid_max), ("threads-max", kernel.threads_max))
        if value is not None
    }
    if per_session is None or not limits:
        return []
    name, limit = min(limits.items(), key=lambda item: item[1])
    sessions = session_capacity(host)
    total = sessions * per_session
    if sessions == 0 or total <= limit:
        return []
    extra = per_session - pids
    each = f"{per_session} ({pids} + {extra} for the FTP server)" if extra else f"{pids}"
    fitting = limit // sessions - extra
    lower = (
        f"lower limits.pids to {fitting} or less"
        if fitting >= 64
        else "narrow the port ranges to fewer sessions"
    )
    # pid_max cannot go past PID_MAX_LIMIT; threads-max is bounded by memory: twice the need
    wanted = PID_MAX_LIMIT if name == "pid_max" else total * 2
    fix = (
        f"raise it (sysctl -w kernel.{name}={wanted}, and the same line in /etc/sysctl.d/) "
        f"or {lower}"
        if wanted >= total
        else lower
    )
    return [
        f"limits.pids: {sessions} sessions of hosts[{index}] ({host.name}; as many as its "
        f"ports and GPUs allow) may each take {each} processes: {total} in all, more than "
        f"kernel.{name} ({limit}) on this machine; one session forking to its limit can "
        f"leave the others, sshd and gpuresa unable to fork: {fix}"
    ]
