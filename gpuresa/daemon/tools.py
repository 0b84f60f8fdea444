"""What every part of the loop uses: the context of the moment, the clock, the executor.

The loop's parts (the survey of the engine, the calendar poll, the rounds,
GPU telemetry, housekeeping) each own their state and share only this. A
reload swaps `context`; every part reads it from here at the time it acts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from gpuresa.daemon.clock import Clock
from gpuresa.daemon.executor import Executor
from gpuresa.daemon.state import Context
from gpuresa.observe.state import Counters

Result = TypeVar("Result")


@dataclass
class Tools:
    """The loop's shared tools; used on the loop thread (but `post`, from any)."""

    context: Context
    clock: Clock
    executor: Executor
    counters: Counters
    post: Callable[[Callable[[], None]], None]
    # the background jobs' threads (a poll, a survey, the outputs duty...), for a shutdown
    threads: list[threading.Thread] = field(default_factory=list)

    def background_running(self) -> list[str]:
        """The names of the background jobs still under way."""
        self.threads = [thread for thread in self.threads if thread.is_alive()]
        return [thread.name for thread in self.threads]

    def background(
        self, name: str, work: Callable[[], Result], done: Callable[[Result | Exception], None]
    ) -> None:
        """Run `work` on a thread of its own and `done(result or error)` on the loop."""

        def run() -> None:
            try:
                result: Result | Exception = work()
            except Exception as error:
                result = error
            self.post(lambda: done(result))

        thread = threading.Thread(target=run, name=f"gpuresa-{name}", daemon=True)
        self.threads = [thread for thread in self.threads if thread.is_alive()] + [thread]
        thread.start()
