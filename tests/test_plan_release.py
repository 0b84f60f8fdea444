"""No-shows in the pure planner: a session nobody logged into is warned, then released.

Table tests over `plan` and `wakeups` (no I/O, no clock), on the planner's test
host with `release_unused` set on the host, on a calendar, or on neither.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from test_plan import INVENTORY, T0, booking, kinds, running

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.planning.actions import Action, NotifyRelease, Start, Stop
from gpuresa.planning.facts import Memory
from gpuresa.planning.planner import plan
from gpuresa.planning.release import LOG_LAG, release_after, release_times
from gpuresa.planning.wakeups import wakeups
from gpuresa.reservations.conflicts import resolve_conflicts

MINUTE = timedelta(minutes=1)
SECOND = timedelta(seconds=1)


def config_with(host: str | None = "30m", calendar: str | None = None, **daemon: str) -> Config:
    """The planner's test host (`test_plan.CONFIG`) with `release_unused` where given."""
    host_table = {"name": "gpu1", "gpus": [0, 1, 2, 3], "gpu_mode": "nvidia",
                  "ssh_ports": "20000-20002", "ftp_ports": "21000-21009",
                  "ftp_passive_ports": "30000-30099", "ftp_passive_per_session": 10}  # fmt: skip
    if host is not None:
        host_table["release_unused"] = host
    calendar_table: dict[str, object] = {"name": "gpu1", "url": "/srv/ics", "kind": "ics"}
    if calendar is not None:
        calendar_table["release_unused"] = calendar
    return parse_config(
        {
            "daemon": {"host": "gpu1", "stop_grace": "30s", **daemon},
            "hosts": [host_table],
            "calendars": [calendar_table],
        }
    )


CONFIG = config_with()
GRACE = CONFIG.daemon.stop_grace
BOOKED = booking("booked", T0, hours=4)
SESSION = running(BOOKED, (0,))
# the session let its user in at its booking's start
UP = Memory(up_since={"booked": T0})


def releases(actions: list[Action]) -> list[Action]:
    return [action for action in actions if isinstance(action, NotifyRelease | Stop)]


def test_off_by_default_and_ten_minutes_notice() -> None:
    plain = parse_config({"daemon": {"host": "h"}, "hosts": [{"name": "h", "gpus": [0]}]})
    assert plain.host().release_unused is None
    assert plain.daemon.release_notice == timedelta(minutes=10)
    assert release_after(BOOKED, config_with(host=None)) is None
    # hours after the start, nothing for a booking on a host that does not release
    later = T0 + timedelta(hours=3)
    assert releases(plan([BOOKED], [SESSION], INVENTORY, later, config_with(host=None))) == []


@pytest.mark.parametrize(
    ("host", "calendar", "expected"),
    [
        ("30m", None, timedelta(minutes=30)),
        (None, "45m", timedelta(minutes=45)),
        ("30m", "1h", timedelta(hours=1)),  # the calendar's own wins
    ],
)
def test_the_calendars_setting_wins_over_the_hosts(
    host: str | None, calendar: str | None, expected: timedelta
) -> None:
    assert release_after(BOOKED, config_with(host, calendar)) == expected


def test_warned_at_its_notice_then_released_on_a_check_made_at_its_time() -> None:
    warn_at, release_at = T0 + 20 * MINUTE, T0 + 30 * MINUTE
    assert release_times(BOOKED, CONFIG) == (warn_at, release_at)
    assert releases(plan([BOOKED], [SESSION], INVENTORY, warn_at - SECOND, CONFIG, UP)) == []
    told = plan([BOOKED], [SESSION], INVENTORY, warn_at, CONFIG, UP)
    assert releases(told) == [NotifyRelease("booked", release_at=release_at)]
    memory = dataclasses.replace(UP, release_notified={"booked": release_at})
    # told once; nothing more before its time
    assert releases(plan([BOOKED], [SESSION], INVENTORY, release_at - SECOND, CONFIG, memory)) == []
    # at its time, only a check of the logins begun then or later (the log's lag after)
    # releases it
    for early in (release_at - SECOND, release_at, release_at + LOG_LAG - SECOND):
        checked_before = dataclasses.replace(memory, unused_seen={"booked": early})
        later = release_at + 2 * LOG_LAG
        assert releases(plan([BOOKED], [SESSION], INVENTORY, later, CONFIG, checked_before)) == []
    checked = dataclasses.replace(memory, unused_seen={"booked": release_at + LOG_LAG})
    stop = plan([BOOKED], [SESSION], INVENTORY, release_at + SECOND, CONFIG, checked)
    assert releases(stop) == [Stop("booked", reason="released", grace=GRACE)]


def test_a_session_seen_used_is_never_released() -> None:
    release_at = T0 + 30 * MINUTE
    memory = dataclasses.replace(
        UP,
        used=frozenset({"booked"}),
        release_notified={"booked": release_at},
        unused_seen={"booked": release_at + SECOND},
    )
    for now in (T0 + 20 * MINUTE, release_at + MINUTE, T0 + 3 * timedelta(hours=1)):
        assert releases(plan([BOOKED], [SESSION], INVENTORY, now, CONFIG, memory)) == []
    assert [instant for instant in wakeups([BOOKED], [SESSION], INVENTORY, T0, CONFIG, memory)
            if T0 < instant < BOOKED.end - timedelta(minutes=15)] == []  # fmt: skip


def test_a_daemon_down_at_the_warning_still_gives_the_whole_notice() -> None:
    late = T0 + 40 * MINUTE  # after the release time, never told
    told = plan([BOOKED], [SESSION], INVENTORY, late, CONFIG, UP)
    assert releases(told) == [NotifyRelease("booked", release_at=late + 10 * MINUTE)]


def test_the_time_to_log_in_runs_from_when_the_session_let_its_user_in() -> None:
    # the engine was down: the session came up 50 minutes into its booking
    up = T0 + 50 * MINUTE
    late_start = Memory(up_since={"booked": up})
    assert release_times(BOOKED, CONFIG, up) == (up + 20 * MINUTE, up + 30 * MINUTE)
    assert releases(plan([BOOKED], [SESSION], INVENTORY, up + MINUTE, CONFIG, late_start)) == []
    told = plan([BOOKED], [SESSION], INVENTORY, up + 20 * MINUTE, CONFIG, late_start)
    assert releases(told) == [NotifyRelease("booked", release_at=up + 30 * MINUTE)]
    # and nothing at all before the daemon knows when it came up
    assert releases(plan([BOOKED], [SESSION], INVENTORY, T0 + 3 * 60 * MINUTE, CONFIG)) == []


def test_the_notice_is_at_most_half_the_time_given() -> None:
    config = config_with(host="8m")
    assert release_times(BOOKED, config) == (T0 + 4 * MINUTE, T0 + 8 * MINUTE)


def test_a_booking_that_ends_before_its_release_is_never_released() -> None:
    short = booking("short", T0, hours=0.5)
    assert release_times(short, CONFIG) is None
    assert release_times(booking("longer", T0, hours=0.51), CONFIG) is not None


@pytest.mark.parametrize("state", ["created", "stopped"])
def test_only_a_running_session_is_released(state: str) -> None:
    session = dataclasses.replace(SESSION, state=state)
    memory = Memory(
        release_notified={"booked": T0},
        unused_seen={"booked": T0 + MINUTE},
        up_since={"booked": T0},
    )
    actions = plan([BOOKED], [session], INVENTORY, T0 + 40 * MINUTE, CONFIG, memory)
    assert not [action for action in actions if isinstance(action, NotifyRelease)]
    assert Stop("booked", reason="released", grace=GRACE) not in actions


def test_a_preemptible_session_is_never_released() -> None:
    soft = dataclasses.replace(BOOKED, preemptible=True)
    session = dataclasses.replace(SESSION, preemptible=True)
    assert release_after(soft, CONFIG) is None
    actions = plan([soft], [session], INVENTORY, T0 + 40 * MINUTE, CONFIG, UP)
    assert not [action for action in actions if isinstance(action, NotifyRelease)]


def test_a_released_booking_is_not_started_again_and_claims_no_gpu() -> None:
    memory = Memory(released=frozenset({"booked"}))
    later = T0 + 40 * MINUTE
    assert kinds(plan([BOOKED], [], INVENTORY, later, CONFIG, memory)) == []
    # a walk-in for every GPU, booked after it: over-booking keeps both (the released one
    # is held like a preemptible one: `daemon.state` passes its key so), and it starts
    walk_in = booking("walk-in", later, hours=1, gpus=4, user="bob")
    seen = {"booked": T0 - timedelta(days=1), "walk-in": later}
    kept = resolve_conflicts([BOOKED, walk_in], CONFIG, first_seen=seen, preemptible={"booked"})
    assert {item.key for item in kept.reservations} == {"booked", "walk-in"} and not kept.rejected
    actions = plan(list(kept.reservations), [], INVENTORY, later, CONFIG, memory)
    (start,) = [action for action in actions if isinstance(action, Start)]
    assert isinstance(start, Start) and start.key == "walk-in"
    assert start.spec is not None and start.spec.gpu_indices == (0, 1, 2, 3)


def test_the_daemon_plans_again_at_the_warning_and_the_release() -> None:
    instants = wakeups([BOOKED], [SESSION], INVENTORY, T0, CONFIG, UP)
    assert {T0 + 20 * MINUTE, T0 + 30 * MINUTE} <= set(instants)
