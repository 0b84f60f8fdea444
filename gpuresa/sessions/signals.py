"""Which of a session's processes catch a signal: the only ones a warning is sent to.

A warning (`SessionBackend.signal`: a preemptible session told it must stop)
must end nothing: SIGUSR1, SIGUSR2, SIGHUP and SIGINT end a process that does
not handle them, a training run or a login shell among them. So it goes only
to processes that installed a handler for it, as the kernel shows in
`/proc/<pid>/status` (`SigCgt`, a mask of caught signals): a checkpointing
script that asks for it gets it, nothing else notices.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def catches(pid: int, number: signal.Signals, proc: Path = PROC) -> bool:
    """Whether process `pid` has a handler for `number` (False when it is gone)."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            try:
                mask = int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return False
            return bool(mask >> (int(number) - 1) & 1)
    return False


def catching(pids: Iterable[int], number: signal.Signals, proc: Path = PROC) -> list[int]:
    """The pids among `pids` that catch `number`, in order."""
    return [pid for pid in sorted(pids) if catches(pid, number, proc)]
