"""No-shows: a firm session nobody logged into is warned, then released.

Where a calendar or a host sets `release_unused`, a firm session whose user
has not logged in (SSH, SFTP or FTP: what the backend's `used` tells) that
long after its booking's start is ended, its output kept, and its booking
holds its GPUs no more: preemptible and walk-in bookings may take them. The
user is told `daemon.release_notice` before (or half of `release_unused`,
if shorter), and the end comes no sooner than that notice after the telling,
so a daemon that was down at the warning's time still warns before it
releases; and it comes only once a check of the session's logins that began
at that time or later found none (`Memory.unused_seen`). One login is enough,
for good: what a user does afterwards is theirs to decide (a login that then
leaves holds its booking as a login that stays would).

Preemptible sessions are never released (they give way anyway), nor ad-hoc
ones (an admin made them). The time runs from the booking's start, or from
when the session let its user in if that came later (`Memory.up_since`): a
start the engine delayed costs the user nothing. Pure, like the planner.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session
from gpuresa.planning.actions import NotifyRelease, Stop
from gpuresa.planning.facts import Memory

# how long a login's line may take to reach the log a check reads (an engine ships its
# containers' output through pipes and its own process): a release waits for a check
# begun this long after its time
LOG_LAG = timedelta(seconds=2)


def release_after(reservation: Reservation, config: Config) -> timedelta | None:
    """How long after its start `reservation`'s session must have seen a login, or None
    (never released): its calendar's `release_unused`, else its host's."""
    if reservation.preemptible:
        return None
    for calendar in config.calendars:
        if calendar.name == reservation.calendar and calendar.release_unused is not None:
            return calendar.release_unused
    for host in config.hosts:
        if host.name == reservation.host:
            return host.release_unused
    return None


def release_times(
    reservation: Reservation, config: Config, up_since: datetime | None = None
) -> tuple[datetime, datetime] | None:
    """(when the warning is due, when the session is released), or None when it never
    is (release off, or a booking that ends before its release would come). The time
    runs from the booking's start, or from when its session let its user in (`up_since`)
    if later: a late start (an engine slow or down) costs the user nothing."""
    after = release_after(reservation, config)
    if after is None:
        return None
    release_at = max(reservation.start, up_since or reservation.start) + after
    if release_at >= reservation.end:
        return None
    return release_at - release_notice(after, config), release_at


def release_notice(after: timedelta, config: Config) -> timedelta:
    """How long before its release a session is told: the daemon's notice, at most half
    of the time it was given."""
    return min(config.daemon.release_notice, after / 2)


def release_action(
    session: Session, reservation: Reservation, now: datetime, config: Config, memory: Memory
) -> NotifyRelease | Stop | None:
    """The warning or the release due for a running session with no login yet, else None."""
    up_since = memory.up_since.get(session.key)
    if session.state != "running" or session.key in memory.used or up_since is None:
        return None
    times = release_times(reservation, config, up_since)
    if times is None:
        return None
    warn_at, release_at = times
    told = memory.release_notified.get(session.key)
    if told is not None and now >= told:
        # only on a check that began at that time or later (and the log's lag after): a
        # login just before counts
        checked = memory.unused_seen.get(session.key)
        if checked is None or checked < told + LOG_LAG:
            return None
        return Stop(session.key, reason="released", grace=config.daemon.stop_grace)
    if told is None and now >= warn_at:
        # told late (the daemon was down at warn_at): the whole notice all the same
        notice = release_notice(release_after(reservation, config) or timedelta(0), config)
        at = max(release_at, now + notice) if now > warn_at + timedelta(seconds=5) else release_at
        return NotifyRelease(session.key, release_at=min(at, reservation.end))
    return None


def release_wakeups(reservation: Reservation, config: Config, memory: Memory) -> list[datetime]:
    """The instants at which `release_action` may answer differently for `reservation`."""
    up_since = memory.up_since.get(reservation.key)
    if reservation.key in memory.used or up_since is None:
        return []
    times = release_times(reservation, config, up_since)
    instants = list(times) if times is not None else []
    told = memory.release_notified.get(reservation.key)
    if told is not None:
        instants.append(told)
    return instants
