"""How much memory and CPU a session may use: a share of its host, as its GPUs are.

A session that booked 2 of a host's 8 GPUs gets 2/8 of the host's CPUs and
memory, less a reserve the host keeps for itself (its daemons, page cache,
sshd for users who log in to the host): `[limits] reserve_cpus` (1 CPU) and
`reserve_memory` (10%). A session without GPUs counts as one GPU's share; on a
host without GPUs every session may use all of it but the reserve. Explicit
`[limits] cpus` and `memory` apply to every session as they are.

The cgroup limits the engine sets are hard: a session over its memory is
OOM-killed inside its own cgroup (swap is not added on top), one over its
CPUs is throttled; the other sessions and the host keep theirs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from gpuresa.config.schema import Share, Size
from gpuresa.config.sections import LimitsConfig

# the smallest limits a session is ever given, whatever its share (sshd and a shell)
MIN_SESSION_MEMORY = 256 << 20
MIN_SESSION_CPUS = 0.1
# Docker's NanoCpus: CPUs are given in hundredths
CPU_STEP = 0.01
MEMORY_STEP = 1 << 20

# the FTP sidecar: vsftpd and a few transfers, whatever the session's share
FTP_CPUS = 0.5
FTP_MEMORY = 256 << 20


@dataclass(frozen=True)
class HostTotals:
    """What a host has: CPUs, memory in bytes, GPUs it hands out."""

    cpus: float
    memory: int
    gpus: int


@dataclass(frozen=True)
class SessionLimits:
    """The CPUs and memory (bytes) one session may use."""

    cpus: float
    memory: int

    def describe(self) -> str:
        return f"{self.cpus:g} CPUs, {self.memory / (1 << 30):.1f} GiB memory"


def session_limits(limits: LimitsConfig, totals: HostTotals, booked: int) -> SessionLimits:
    """The limits of a session that booked `booked` GPUs on a host with `totals`.

    Each is `[limits]`'s value when set, else (total - reserve) * share, where
    share is max(booked, 1) / gpus (1 on a host without GPUs, never more than
    1), rounded down to a hundredth of a CPU and a MiB, and never below
    `MIN_SESSION_CPUS` and `MIN_SESSION_MEMORY` (a host too small for its
    reserve still runs sessions).
    """
    share = min(max(booked, 1) / totals.gpus, 1.0) if totals.gpus > 0 else 1.0
    if limits.cpus is not None:
        cpus = limits.cpus
    else:
        free_cpus = max(totals.cpus - limits.reserve_cpus, 0.0)
        # the small epsilon keeps 0.29999… from becoming 0.28
        cpus = math.floor(free_cpus * share / CPU_STEP + 1e-9) * CPU_STEP
        cpus = max(round(cpus, 2), MIN_SESSION_CPUS)
    if limits.memory is not None:
        memory = limits.memory.bytes
    else:
        free = _reserve_free(limits.reserve_memory, totals.memory) * share
        memory = max(int(free // MEMORY_STEP) * MEMORY_STEP, MIN_SESSION_MEMORY)
    return SessionLimits(cpus, memory)


def _reserve_free(reserve: Size | Share, total: int) -> float:
    kept = reserve.of(total) if isinstance(reserve, Share) else reserve.bytes
    return max(total - kept, 0)


def totals_from_info(info: dict[str, Any], gpus: int) -> HostTotals:
    """A host's totals from the engine's `info` (NCPU, MemTotal: both engines give them)."""
    return HostTotals(float(info.get("NCPU") or 1), int(info.get("MemTotal") or 0), gpus)


def local_totals(gpus: int) -> HostTotals:
    """This machine's totals (for `gpuresa config`, which asks no engine)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HostTotals(float(os.cpu_count() or 1), memory, gpus)


def limit_settings(limits: LimitsConfig, session: SessionLimits) -> dict[str, Any]:
    """The HostConfig settings of a session's main container: CPUs, memory, shm, processes.

    MemorySwap equal to Memory: a session cannot page out past its limit and
    slow the host down instead of being stopped.
    """
    return {
        "NanoCpus": round(session.cpus * 1_000_000_000),
        "Memory": session.memory,
        "MemorySwap": session.memory,
        "ShmSize": limits.shm_size.bytes,
        "PidsLimit": limits.pids,
    }


def ftp_limit_settings() -> dict[str, Any]:
    """The FTP sidecar's fixed CPU and memory limits (its pids limit is in the payload)."""
    return {
        "NanoCpus": int(FTP_CPUS * 1_000_000_000),
        "Memory": FTP_MEMORY,
        "MemorySwap": FTP_MEMORY,
    }
