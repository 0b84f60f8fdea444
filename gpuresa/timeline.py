"""The most GPUs bookings hold at once over a span: one sweep, for over-booking and rules."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol


class Holds(Protocol):
    """What holds GPUs over a time: a reservation, a rule's booking."""

    @property
    def start(self) -> datetime: ...

    @property
    def end(self) -> datetime: ...

    @property
    def gpus(self) -> int: ...


def peak_gpus(items: Sequence[Holds], start: datetime, end: datetime) -> int:
    """The most GPUs `items` (which all overlap [start, end)) hold at once during it."""
    if len(items) < 2:
        # the common case, no sweep needed: none, or one booking alongside
        return items[0].gpus if items else 0
    changes: list[tuple[datetime, int]] = []
    for other in items:
        changes.append((other.start if other.start > start else start, other.gpus))
        changes.append((other.end if other.end < end else end, -other.gpus))
    changes.sort()  # at one instant, an end (negative) comes before a start
    used = peak = 0
    for _, delta in changes:
        used += delta
        if used > peak:
            peak = used
    return peak
