"""Which processes a warning reaches (`gpuresa.sessions.signals`): those that handle it.

Real processes of this machine: one that traps the signal, one that does not,
one that ignores it; the kernel's own masks decide.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_for

from gpuresa.sessions.signals import catches, catching

SCRIPTS = {
    "traps": "import signal, time\nsignal.signal(signal.SIGUSR1, lambda *_: None)\n",
    "default": "import time\n",
    "ignores": "import signal, time\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\n",
}


@pytest.fixture(name="processes")
def started_processes(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    started = {}
    for name, head in SCRIPTS.items():
        ready = tmp_path / name
        code = head + f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n"
        started[name] = subprocess.Popen([sys.executable, "-c", code])
    wait_for(lambda: all((tmp_path / name).exists() for name in SCRIPTS), 20, "them to be ready")
    yield started
    for process in started.values():
        process.kill()
        process.wait()


def test_only_a_process_with_a_handler_catches_the_signal(
    processes: dict[str, subprocess.Popen[bytes]],
) -> None:
    pids = {name: process.pid for name, process in processes.items()}
    assert catches(pids["traps"], signal.SIGUSR1)
    assert not catches(pids["default"], signal.SIGUSR1)
    assert not catches(pids["ignores"], signal.SIGUSR1)
    # another signal of the same process: not caught
    assert not catches(pids["traps"], signal.SIGUSR2)
    assert catching(pids.values(), signal.SIGUSR1) == [pids["traps"]]


def test_a_gone_process_or_an_unreadable_status_catches_nothing(tmp_path: Path) -> None:
    assert not catches(2**22 + 7, signal.SIGUSR1)
    fake = tmp_path / "123"
    fake.mkdir()
    (fake / "status").write_text("Name:\tx\nSigCgt:\tnot-hex\n")
    assert not catches(123, signal.SIGUSR1, proc=tmp_path)
    (fake / "status").write_text("Name:\tx\nSigCgt:\t0000000000000200\n")
    assert catches(123, signal.SIGUSR1, proc=tmp_path)  # SIGUSR1 is 10: bit 9
