"""Images built in the background while the sessions that need them wait.

A start or a preparation whose image is not here yet fails with
`ImageMissing`; its session waits (looking again every `IMAGE_WAIT`) while
the image is built on a thread of its own, and goes on at once when the
build finishes, or fails when it cannot be built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from gpuresa.daemon.memory import Remembered
from gpuresa.daemon.tools import Tools
from gpuresa.model import Reservation

log = logging.getLogger(__name__)

# How often a session waiting for its image's build looks again (a finished
# build also wakes the loop at once).
IMAGE_WAIT = timedelta(seconds=10)

Wanted = tuple[str | None, str | None]


class Builds:
    """The builds under way and the sessions that wait for them.

    `reservation(key)`: the booking of a session (for its user's failure
    notice). `changed()`: called after each build (plan again).
    """

    def __init__(
        self,
        tools: Tools,
        remembered: Remembered,
        reservation: Callable[[str], Reservation | None],
        changed: Callable[[], None],
    ) -> None:
        self.tools = tools
        self.remembered = remembered
        self.reservation = reservation
        self.changed = changed
        self.builds: set[Wanted] = set()
        self.waiting: dict[str, Wanted] = {}

    def wait_for(self, key: str, template: str | None, cuda: str | None, now: datetime) -> None:
        """Session `key` waits for the image of (`template`, `cuda`); built unless under way."""
        self.remembered.retry_after[key] = now + IMAGE_WAIT
        wanted = (template, cuda)
        self.waiting[key] = wanted
        if wanted in self.builds:
            return
        self.builds.add(wanted)
        what = f"{template} (CUDA {cuda or 'default'})" if template else "the FTP sidecar"
        log.info("%s: building the image of %s in the background", key, what)
        work = self.tools.context.work
        self.tools.background(
            "build", lambda: work.build(template, cuda), lambda result: self._built(wanted, result)
        )

    def _built(self, wanted: Wanted, result: object) -> None:
        """A build finished: the sessions that waited for it go on at once (or fail)."""
        self.builds.discard(wanted)
        if isinstance(result, Exception):
            self.tools.counters.count_error("build")
        context = self.tools.context
        now = self.tools.clock.now()
        for key in [key for key, image in self.waiting.items() if image == wanted]:
            del self.waiting[key]
            self.remembered.retry_after.pop(key, None)
            if isinstance(result, Exception):
                attempts = self.remembered.back_off(key, now)
                reason = f"the image could not be built: {result}"
                context.journal.states.set(key, "failed", now, f"attempt {attempts}: {reason}")
                reservation = self.reservation(key)
                if attempts == 1 and reservation is not None:
                    context.notices.failure(key, reservation.user, reservation.email, reason)
        self.changed()
