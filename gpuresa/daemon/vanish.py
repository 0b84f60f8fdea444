"""A calendar that suddenly loses most of its running bookings is not believed at once.

A server migration, a wrong URL or an empty but valid collection reads as
"every booking was cancelled". Believed, it would stop every running session
a few minutes later. So when one poll loses most of the bookings that have a
session, those bookings are kept as they were until the loss has lasted
`confirm` (several polls); the admin is told when the hold begins. A single
cancellation is never held: only a loss of at least two bookings that is
more than half of those with a session.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpuresa.model import Reservation

# A loss this large (and more than half of the bookings with a session) is held.
MIN_HELD_LOSS = 2


@dataclass(frozen=True)
class Hold:
    """Bookings kept although the calendar no longer lists them, since `since`."""

    since: datetime
    kept: tuple[Reservation, ...]

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(reservation.key for reservation in self.kept)


@dataclass(frozen=True)
class Screened:
    """What the daemon should plan with after a poll, and the hold that is now in force."""

    reservations: tuple[Reservation, ...]
    hold: Hold | None
    # the hold began with this poll: tell the admin
    began: bool = False
    # the hold ended because the loss lasted `confirm`: the calendar is believed
    confirmed: bool = False


def screen(
    previous: Sequence[Reservation],
    current: Sequence[Reservation],
    with_session: Collection[str],
    hold: Hold | None,
    now: datetime,
    confirm: timedelta,
) -> Screened:
    """The reservations to plan with, given the last ones planned with and a new poll's.

    `with_session` holds the keys that have a prepared or running session;
    `hold` is the hold returned last time (None when none).
    """
    current_keys = {reservation.key for reservation in current}
    if hold is not None:
        still_missing = tuple(item for item in hold.kept if item.key not in current_keys)
        if not still_missing:
            return Screened(tuple(current), None)
        if now - hold.since >= confirm:
            return Screened(tuple(current), None, confirmed=True)
        kept = Hold(hold.since, still_missing)
        return Screened((*current, *still_missing), kept)
    held = [item for item in previous if item.key in with_session]
    lost = tuple(item for item in held if item.key not in current_keys and item.end > now)
    if len(lost) >= MIN_HELD_LOSS and 2 * len(lost) > len(held):
        return Screened((*current, *lost), Hold(now, lost), began=True)
    return Screened(tuple(current), None)
