"""What is free from now: per GPU (its holder and next free interval), or a count over time.

Pure: reservations, sessions and `now` in, intervals and sentences out. The
GPUs a booking gets here must be the ones the planner gives it (a property
test runs both on the same bookings).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuresa.config.reading import parse_config
from gpuresa.model import Reservation, Session
from gpuresa.observe.free import free_json, free_lines, free_view, still_booked
from gpuresa.planning.actions import Prepare, Start
from gpuresa.planning.facts import Inventory
from gpuresa.planning.free_gpus import CountFree, free_count, free_gpus, gpu_holds
from gpuresa.planning.planner import plan

# 10:00 UTC is 11:00 in Paris (CET) on this day
NOW = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
PARIS = ZoneInfo("Europe/Paris")


def booking(
    key: str, start: datetime, hours: float, user: str = "alice", gpus: int = 1
) -> Reservation:
    return Reservation(
        key=key, uid=key.split("@")[0], recurrence_id=None, calendar="lab", host="gpu1",
        user=user, template="pytorch", cuda=None, gpus=gpus, start=start,
        end=start + timedelta(hours=hours),
    )  # fmt: skip


def session(
    key: str,
    user: str,
    gpus: tuple[int, ...],
    start: datetime,
    end: datetime,
    state: str = "running",
    count: int | None = None,
    port: int = 20000,
) -> Session:
    return Session(
        key=key, user=user, host="gpu1", template="pytorch", cuda=None,
        gpu_count=len(gpus) if count is None else count, gpu_indices=gpus, start=start, end=end,
        ssh_port=port, ftp_port=port + 1000, ftp_passive_first=30000 + (port - 20000) * 10,
        ftp_passive_last=30009 + (port - 20000) * 10, state=state, output_dir=Path("/out") / key,
    )  # fmt: skip


def running_for(reservation: Reservation, gpus: tuple[int, ...]) -> Session:
    return session(reservation.key, reservation.user, gpus, reservation.start, reservation.end)


BOB = booking("bob-1", NOW - 2 * HOUR, 3.5, "bob")  # until 11:30 UTC
CAROL = booking("carol-1", NOW + 3 * HOUR, 2, "carol")  # 13:00-15:00 UTC
DAVE = booking("dave-1", NOW + 1.5 * HOUR, 1, "dave")  # 11:30-12:30 UTC, right after bob
# a daily series: one occurrence (one key) a day, the first one running
DAILY = [
    booking(f"daily@202611{day}T140000Z", NOW.replace(day=day, hour=14), 1) for day in (23, 24, 25)
]

CASES = [
    pytest.param(
        [],
        [],
        (0, 1),
        ["free until further notice", "free until further notice"],
        id="no-booking",
    ),
    pytest.param(
        [booking("alice-1", NOW + 4 * HOUR, 2)],
        [],
        (0, 1),
        [
            "free now, until 2026-11-23 15:00 CET (alice's booking)",
            "free until further notice",
        ],
        id="booking-later-today",
    ),
    pytest.param(
        [BOB, CAROL],
        [running_for(BOB, (0,))],
        (0,),
        [
            "busy (bob, until 2026-11-23 12:30 CET), then free until 2026-11-23 14:00 CET "
            "(carol's booking)"
        ],
        id="running-session-then-a-gap",
    ),
    pytest.param(
        [BOB, DAVE, CAROL],
        [running_for(BOB, (0,))],
        (0, 1),
        [
            "busy (bob, until 2026-11-23 12:30 CET), then booked until 2026-11-23 13:30 CET, "
            "then free until 2026-11-23 14:00 CET (carol's booking)",
            "free until further notice",
        ],
        id="back-to-back-bookings",
    ),
    pytest.param(
        # the next occurrence gets the lowest GPU free then, as the planner gives it
        DAILY,
        [running_for(DAILY[0], (1,))],
        (0, 1),
        [
            "free now, until 2026-11-24 15:00 CET (alice's booking)",
            "busy (alice, until 2026-11-23 16:00 CET), then free until further notice",
        ],
        id="recurring-booking",
    ),
    pytest.param(
        # the booking was extended: the planner keeps the session's GPUs to the new end
        [replace(BOB, end=BOB.end + HOUR)],
        [running_for(BOB, (0,))],
        (0,),
        ["busy (bob, until 2026-11-23 13:30 CET), then free until further notice"],
        id="extended-booking",
    ),
    pytest.param(
        # a prepared session waits for its booking: free until then
        [CAROL],
        [session(CAROL.key, "carol", (1,), CAROL.start, CAROL.end, "created")],
        (0, 1),
        ["free until further notice", "free now, until 2026-11-23 14:00 CET (carol's booking)"],
        id="prepared-session",
    ),
]


@pytest.mark.parametrize(("reservations", "sessions", "gpus", "expected"), CASES)
def test_each_gpu_says_how_long_it_stays_free(
    reservations: list[Reservation], sessions: list[Session], gpus: tuple[int, ...],
    expected: list[str],
) -> None:  # fmt: skip
    # the series' first occurrence runs at 14:30
    now = NOW.replace(hour=14, minute=30) if reservations is DAILY else NOW
    view = free_view(reservations, sessions, gpus, False, now)
    assert [sentence for _, sentence in free_lines(view, PARIS)] == expected
    assert [label for label, _ in free_lines(view, PARIS)] == [f"GPU {index}" for index in gpus]


def test_intervals_name_their_holder_and_what_ends_them() -> None:
    [gpu] = free_gpus([BOB, CAROL], [running_for(BOB, (0,))], (0,), NOW)
    assert gpu.holder is not None and (gpu.holder.key, gpu.holder.end) == ("bob-1", BOB.end)
    assert (gpu.free_from, gpu.free_until) == (BOB.end, CAROL.start)
    assert gpu.ended_by is not None and gpu.ended_by.key == "carol-1"
    shown = free_json(free_view([BOB, CAROL], [running_for(BOB, (0,))], (0,), False, NOW), PARIS)
    assert shown["mode"] == "gpus"
    [item] = shown["gpus"]
    assert item["holder"]["user"] == "bob" and item["free_until"] == CAROL.start.isoformat()
    assert item["ended_by"] == {
        "key": "carol-1", "user": "carol",
        "from": CAROL.start.isoformat(), "until": CAROL.end.isoformat(),
    }  # fmt: skip


def test_a_booking_no_gpu_fits_holds_none() -> None:
    # over-booked (the planner would refuse it): it must not pass for a holder
    crowded = booking("late-1", NOW + HOUR, 1, "mallory")
    [gpu] = free_gpus([BOB, crowded], [running_for(BOB, (0,))], (0,), NOW)
    assert gpu.holder is not None and gpu.holder.key == "bob-1"
    assert (gpu.free_from, gpu.free_until, gpu.ended_by) == (BOB.end, None, None)


def test_ended_bookings_and_foreign_gpus_are_left_out() -> None:
    old = booking("old-1", NOW - 5 * HOUR, 1)
    stray = session("stray", "eve", (7,), NOW - HOUR, NOW + HOUR)  # not one of the host's
    assert gpu_holds([old], [stray], (0,), NOW) == {0: []}


def test_count_only_host_shows_how_many_stay_free_until_when() -> None:
    # a Slurm host: the planner books counts, the scheduler picks the devices
    job = session("job-1", "bob", (), NOW - HOUR, NOW + 2 * HOUR, count=2)
    later = booking("big-1", NOW + 3 * HOUR, 1, "carol", gpus=3)
    steps = free_count([later], [job], 4, NOW)
    assert steps == [
        CountFree(NOW, NOW + 2 * HOUR, 2),
        CountFree(NOW + 2 * HOUR, NOW + 3 * HOUR, 4),
        CountFree(NOW + 3 * HOUR, NOW + 4 * HOUR, 1),
        CountFree(NOW + 4 * HOUR, None, 4),
    ]
    view = free_view([later], [job], (0, 1, 2, 3), True, NOW)
    assert free_lines(view, PARIS)[0] == (
        "GPUs",
        "2 of 4 GPU(s) free from 2026-11-23 11:00 CET until 2026-11-23 13:00 CET",
    )
    shown = free_json(view, PARIS)
    assert (shown["mode"], shown["total"]) == ("count", 4)
    assert shown["intervals"][-1]["until"] is None and shown["intervals"][-1]["free"] == 4
    assert free_count([], [], 2, NOW) == [CountFree(NOW, None, 2)]


def test_an_over_booked_count_never_goes_below_zero() -> None:
    # a scheduler may run more than the planner counted (several nodes): never "-1 free"
    crowd = [booking(f"crowd-{n}", NOW - HOUR, 3, gpus=2) for n in range(3)]
    assert free_count(crowd, [], 4, NOW)[0] == CountFree(NOW, NOW + 2 * HOUR, 0)


def test_only_bookings_the_planner_still_sees_count() -> None:
    other_host = replace(CAROL, key="elsewhere", host="gpu2")
    states = {"cancelled-1": "cancelled", "rejected-1": "rejected", "failed-1": "failed"}
    candidates = [
        replace(CAROL, key=key) for key in ("cancelled-1", "rejected-1", "failed-1", "refused")
    ] + [other_host, CAROL]
    kept = still_booked(candidates, "gpu1", states.get, ["refused"])
    # a failed start is tried again: its GPUs stay its own
    assert [item.key for item in kept] == ["failed-1", "carol-1"]


CONFIG = parse_config(
    {
        "daemon": {"host": "gpu1", "prepare_ahead": "7d"},
        "hosts": [
            {
                "name": "gpu1", "gpus": [0, 1, 2, 3], "gpu_mode": "nvidia",
                "ssh_ports": "20000-20099", "ftp_ports": "21000-21099",
                "ftp_passive_ports": "30000-31999", "ftp_passive_per_session": 10,
            }
        ],
    }
)  # fmt: skip

bookings = st.lists(
    st.tuples(st.integers(-3, 20), st.integers(1, 6), st.integers(1, 3)), max_size=8
).map(
    lambda items: [
        booking(f"b{n}", NOW + start * HOUR, hours, f"user{n}", gpus)
        for n, (start, hours, gpus) in enumerate(items)
    ]
)


@settings(max_examples=60, deadline=None)
@given(bookings)
def test_bookings_get_the_gpus_the_planner_gives_them(reservations: list[Reservation]) -> None:
    # the planner prepares every booking at once (prepare_ahead covers them all)
    actions = plan(reservations, [], Inventory(CONFIG.host(), (0, 1, 2, 3)), NOW, CONFIG)
    chosen = {
        action.key: set(action.spec.gpu_indices)
        for action in actions
        if isinstance(action, (Prepare, Start)) and action.spec is not None
    }
    holds = gpu_holds(reservations, [], (0, 1, 2, 3), NOW)
    shown: dict[str, set[int]] = {}
    for index, items in holds.items():
        for hold in items:
            shown.setdefault(hold.key, set()).add(index)
    assert shown == chosen
