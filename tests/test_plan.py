"""The pure planner: table tests for each situation, and properties over random calendars."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session, SessionSpec
from gpuresa.planning.actions import (
    Action,
    Extend,
    Fail,
    NotifyCancel,
    Prepare,
    Recreate,
    Start,
    Stop,
    Warn,
)
from gpuresa.planning.facts import Inventory, Memory
from gpuresa.planning.planner import plan
from gpuresa.planning.wakeups import wakeups

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)

CONFIG = parse_config(
    {
        "daemon": {
            "host": "gpu1",
            "prepare_ahead": "5m",
            "stop_grace": "30s",
            "cancel_grace": "5m",
            "orphan_grace": "10m",
            "warnings": ["15m", "5m"],
        },
        "hosts": [
            {
                "name": "gpu1",
                "gpus": [0, 1, 2, 3],
                "gpu_mode": "nvidia",
                "ssh_ports": "20000-20002",
                "ftp_ports": "21000-21009",
                "ftp_passive_ports": "30000-30099",
                "ftp_passive_per_session": 10,
            }
        ],
    }
)
INVENTORY = Inventory(CONFIG.host(), (0, 1, 2, 3))


def booking(
    key: str,
    start: datetime = T0,
    hours: float = 2,
    gpus: int = 1,
    user: str = "alice",
    host: str = "gpu1",
) -> Reservation:
    return Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar="gpu1",
        host=host,
        user=user,
        template="pytorch",
        cuda="12.4",
        gpus=gpus,
        start=start,
        end=start + timedelta(hours=hours),
        email=f"{user}@example.org",
    )


def session_of(spec: SessionSpec, state: str = "running") -> Session:
    return Session.of(spec, state=state, output_dir=Path("/out") / spec.key)


def running(reservation: Reservation, gpus: tuple[int, ...] = (0,), port: int = 20000) -> Session:
    spec = SessionSpec(
        key=reservation.key,
        user=reservation.user,
        host=reservation.host,
        template=reservation.template,
        cuda=reservation.cuda,
        gpu_count=len(gpus),
        gpu_indices=gpus,
        start=reservation.start,
        end=reservation.end,
        ssh_port=port,
        ftp_port=port + 1000,
        ftp_passive_first=30000 + (port - 20000) * 10,
        ftp_passive_last=30009 + (port - 20000) * 10,
        email=reservation.email,
    )
    return session_of(spec)


def kinds(actions: list[Action]) -> list[tuple[str, str]]:
    return [(type(action).__name__, action.key) for action in actions]


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (T0 - timedelta(minutes=6), []),
        (T0 - timedelta(minutes=5), [("Prepare", "a")]),
        (T0 - timedelta(seconds=1), [("Prepare", "a")]),
        (T0, [("Start", "a")]),
        # the daemon was down at the start: start at once, it has not ended
        (T0 + timedelta(hours=1), [("Start", "a")]),
        # ended before anything was done: nothing to do
        (T0 + timedelta(hours=2), []),
    ],
)
def test_a_booking_without_a_session(now: datetime, expected: list[tuple[str, str]]) -> None:
    assert kinds(plan([booking("a")], [], INVENTORY, now, CONFIG)) == expected


def test_prepare_reserves_gpus_and_ports() -> None:
    actions = plan([booking("a", gpus=2)], [], INVENTORY, T0 - MINUTE, CONFIG)
    assert isinstance(actions[0], Prepare)
    spec = actions[0].spec
    assert spec is not None
    assert spec.gpu_indices == (0, 1)
    assert (spec.ssh_port, spec.ftp_port) == (20000, 21000)
    assert (spec.ftp_passive_first, spec.ftp_passive_last) == (30000, 30009)


def test_prepared_session_starts_at_its_start_with_its_own_ports() -> None:
    reservation = booking("a")
    prepared = dataclasses.replace(running(reservation, port=20001), state="created")
    assert plan([reservation], [prepared], INVENTORY, T0 - MINUTE, CONFIG) == []
    actions = plan([reservation], [prepared], INVENTORY, T0, CONFIG)
    assert kinds(actions) == [("Start", "a")]
    start = actions[0]
    assert isinstance(start, Start) and start.spec is not None
    assert start.spec.ssh_port == 20001


def test_running_session_left_alone_until_its_warnings() -> None:
    reservation = booking("a")
    session = running(reservation)
    assert plan([reservation], [session], INVENTORY, T0 + MINUTE, CONFIG) == []
    actions = plan([reservation], [session], INVENTORY, reservation.end - 15 * MINUTE, CONFIG)
    assert kinds(actions) == [("Warn", "a")]
    assert isinstance(actions[0], Warn) and actions[0].before == 15 * MINUTE
    sent = Memory(warnings_sent=frozenset({("a", 900)}))
    now = reservation.end - 10 * MINUTE
    assert plan([reservation], [session], INVENTORY, now, CONFIG, sent) == []


def test_after_a_restart_only_the_most_urgent_warning_is_sent() -> None:
    reservation = booking("a")
    actions = plan(
        [reservation], [running(reservation)], INVENTORY, reservation.end - 3 * MINUTE, CONFIG
    )
    assert len(actions) == 1
    assert isinstance(actions[0], Warn) and actions[0].before == 5 * MINUTE


@pytest.mark.parametrize("late", [timedelta(0), timedelta(hours=5)])
def test_session_stops_at_its_end(late: timedelta) -> None:
    reservation = booking("a")
    actions = plan([reservation], [running(reservation)], INVENTORY, reservation.end + late, CONFIG)
    assert actions == [Stop("a", reason="ended", grace=timedelta(seconds=30))]


def test_extended_booking_extends_the_session() -> None:
    reservation = booking("a")
    session = running(reservation)
    longer = dataclasses.replace(reservation, end=reservation.end + timedelta(hours=1))
    actions = plan([longer], [session], INVENTORY, reservation.end, CONFIG)
    assert actions == [Extend("a", end=longer.end)]


def test_shortened_booking_warns_and_stops_at_the_new_end() -> None:
    reservation = booking("a")
    session = running(reservation)
    shorter = dataclasses.replace(reservation, end=T0 + timedelta(minutes=30))
    actions = plan([shorter], [session], INVENTORY, T0 + timedelta(minutes=20), CONFIG)
    assert kinds(actions) == [("Extend", "a"), ("Warn", "a")]
    actions = plan([shorter], [session], INVENTORY, shorter.end, CONFIG)
    assert kinds(actions) == [("Stop", "a")]


def test_cancelled_booking_is_warned_then_stopped_after_its_grace() -> None:
    reservation = booking("a")
    session = running(reservation)
    gone = T0 + timedelta(minutes=30)
    memory = Memory(missing_since={"a": gone}, known=frozenset({"a"}))
    # a single poll without the booking may be a bad read: no notice yet
    assert plan([], [session], INVENTORY, gone, CONFIG, memory) == []
    now = gone + CONFIG.daemon.poll_interval
    actions = plan([], [session], INVENTORY, now, CONFIG, memory)
    assert actions == [NotifyCancel("a", stop_at=gone + 5 * MINUTE)]
    told = dataclasses.replace(memory, cancel_notified=frozenset({"a"}))
    assert plan([], [session], INVENTORY, gone + 4 * MINUTE, CONFIG, told) == []
    actions = plan([], [session], INVENTORY, gone + 5 * MINUTE, CONFIG, told)
    assert actions == [Stop("a", reason="cancelled", grace=timedelta(seconds=30))]


def test_orphan_stops_after_the_orphan_grace_without_a_notice() -> None:
    stranger = running(booking("x"))
    now = T0 + timedelta(minutes=30)
    memory = Memory(missing_since={"x": now})
    assert plan([], [stranger], INVENTORY, now + 9 * MINUTE, CONFIG, memory) == []
    actions = plan([], [stranger], INVENTORY, now + 10 * MINUTE, CONFIG, memory)
    assert kinds(actions) == [("Stop", "x")]
    assert isinstance(actions[0], Stop) and actions[0].reason == "orphan"


def test_prepared_session_of_a_cancelled_booking_goes_at_once() -> None:
    prepared = dataclasses.replace(running(booking("a")), state="created")
    memory = Memory(missing_since={"a": T0 - MINUTE}, known=frozenset({"a"}))
    actions = plan([], [prepared], INVENTORY, T0 - MINUTE, CONFIG, memory)
    assert kinds(actions) == [("Stop", "a")]


def test_ad_hoc_session_runs_to_its_own_end() -> None:
    ad_hoc = running(booking("adhoc-1234"))
    assert plan([], [ad_hoc], INVENTORY, T0 + MINUTE, CONFIG) == []
    assert kinds(plan([], [ad_hoc], INVENTORY, ad_hoc.end, CONFIG)) == [("Stop", "adhoc-1234")]


def test_exited_session_is_recreated_with_the_same_ports() -> None:
    reservation = booking("a")
    exited = dataclasses.replace(running(reservation, port=20002), state="stopped")
    actions = plan([reservation], [exited], INVENTORY, T0 + MINUTE, CONFIG)
    assert kinds(actions) == [("Recreate", "a")]
    assert isinstance(actions[0], Recreate) and actions[0].spec is not None
    assert actions[0].spec.ssh_port == 20002


def test_gpus_are_never_shared_and_a_full_host_fails_the_booking() -> None:
    first, second, third = booking("a", gpus=2), booking("b", gpus=2), booking("c", gpus=1)
    actions = plan([first, second, third], [], INVENTORY, T0, CONFIG)
    starts = {action.key: action for action in actions if isinstance(action, Start)}
    assert starts["a"].spec is not None and starts["b"].spec is not None
    assert set(starts["a"].spec.gpu_indices).isdisjoint(starts["b"].spec.gpu_indices)
    failures = [action for action in actions if isinstance(action, Fail)]
    assert [failure.key for failure in failures] == ["c"]
    assert "not free" in failures[0].reason


def test_next_booking_gets_the_gpus_the_ending_one_frees() -> None:
    ending = booking("a", gpus=4)
    following = booking("b", start=ending.end, gpus=4)
    actions = plan(
        [ending, following], [running(ending, (0, 1, 2, 3))], INVENTORY, ending.end, CONFIG
    )
    assert kinds(actions) == [("Stop", "a"), ("Start", "b")]
    start = actions[1]
    assert isinstance(start, Start) and start.spec is not None
    # the ending session's ports stay bound until it is removed
    assert start.spec.ssh_port != 20000 and start.spec.gpu_indices == (0, 1, 2, 3)


def test_port_range_exhausted_fails_the_booking() -> None:
    bookings = [booking(name) for name in "abcd"]
    actions = plan(bookings, [], INVENTORY, T0, CONFIG)
    failures = [action for action in actions if isinstance(action, Fail)]
    assert [failure.key for failure in failures] == ["d"]
    assert "SSH port" in failures[0].reason


def test_failed_and_backed_off_keys_are_not_retried_early() -> None:
    reservation = booking("a")
    memory = Memory(retry_after={"a": T0 + MINUTE})
    assert plan([reservation], [], INVENTORY, T0, CONFIG, memory) == []
    assert kinds(plan([reservation], [], INVENTORY, T0 + MINUTE, CONFIG, memory)) == [
        ("Start", "a")
    ]


def test_prepared_session_whose_gpus_an_extension_took_is_prepared_anew() -> None:
    running_booking = booking("a", start=T0 - timedelta(hours=2), hours=2, gpus=1)
    extended = dataclasses.replace(running_booking, end=T0 + timedelta(minutes=30))
    following = booking("b", gpus=1)
    prepared = dataclasses.replace(running(following, gpus=(0,), port=20001), state="created")
    actions = plan(
        [extended, following],
        [running(running_booking, gpus=(0,)), prepared],
        INVENTORY,
        T0,
        CONFIG,
    )
    assert kinds(actions) == [("Stop", "b"), ("Start", "b"), ("Extend", "a")]
    stop, start = actions[0], actions[1]
    assert isinstance(stop, Stop) and stop.reason == "replan"
    assert isinstance(start, Start) and start.spec is not None
    assert start.spec.gpu_indices == (1,)


@pytest.mark.parametrize(
    "change",
    [
        {"template": "tensorflow"},
        {"user": "bob"},
        {"gpus": 2},
        {"start": T0 + timedelta(hours=3)},
    ],
)
def test_prepared_session_of_a_changed_booking_is_prepared_anew(change: dict[str, object]) -> None:
    original = booking("a")
    prepared = dataclasses.replace(running(original), state="created")
    changed = dataclasses.replace(original, **change)  # type: ignore[arg-type]
    if "start" in change:
        changed = dataclasses.replace(changed, end=changed.start + timedelta(hours=1))
    actions = plan([changed], [prepared], INVENTORY, T0 - MINUTE, CONFIG)
    assert isinstance(actions[0], Stop) and actions[0].reason == "replan"
    moved_away = "start" in change
    assert kinds(actions[1:]) == ([] if moved_away else [("Prepare", "a")])


def test_a_cancelled_session_holds_its_gpus_only_until_its_grace_ends() -> None:
    cancelled = running(booking("a", gpus=4), gpus=(0, 1, 2, 3))
    memory = Memory(missing_since={"a": T0}, known=frozenset({"a"}), cancel_notified=frozenset("a"))
    later = booking("b", start=T0 + 10 * MINUTE, gpus=4)
    actions = plan([later], [cancelled], INVENTORY, T0 + 6 * MINUTE, CONFIG, memory)
    assert kinds(actions) == [("Stop", "a"), ("Prepare", "b")]


def test_unservable_booking_is_retried_after_its_back_off() -> None:
    blocker = running(booking("adhoc-1", gpus=4), gpus=(0, 1, 2, 3))
    wanted = booking("b", gpus=1)
    actions = plan([wanted], [blocker], INVENTORY, T0, CONFIG)
    assert kinds(actions) == [("Fail", "b")]
    memory = Memory(retry_after={"b": T0 + MINUTE})
    assert (
        plan([wanted], [blocker], INVENTORY, T0 + 30 * timedelta(seconds=1), CONFIG, memory) == []
    )
    freed = plan([wanted], [], INVENTORY, T0 + MINUTE, CONFIG, memory)
    assert kinds(freed) == [("Start", "b")]


def test_other_hosts_bookings_are_ignored() -> None:
    assert plan([booking("a", host="gpu2")], [], INVENTORY, T0, CONFIG) == []


def test_cpu_only_host_gives_no_gpus() -> None:
    host = dataclasses.replace(CONFIG.host(), gpu_mode="none")
    actions = plan([booking("a", gpus=1)], [], Inventory(host, ()), T0, CONFIG)
    assert isinstance(actions[0], Start) and actions[0].spec is not None
    assert actions[0].spec.gpu_indices == ()


def test_wakeups_cover_prepare_start_warnings_and_end() -> None:
    reservation = booking("a")
    times = wakeups([reservation], [], INVENTORY, T0 - timedelta(hours=1), CONFIG)
    assert times == [
        T0 - 5 * MINUTE,
        T0,
        reservation.end - 15 * MINUTE,
        reservation.end - 5 * MINUTE,
        reservation.end,
    ]
    cancelled = running(booking("b"))
    memory = Memory(missing_since={"b": T0}, known=frozenset({"b"}))
    assert T0 + 5 * MINUTE in wakeups([], [cancelled], INVENTORY, T0, CONFIG, memory)


# --- properties over a simulated engine ------------------------------------------------


class SimulatedEngine:
    """Applies actions the way the runtime would; a fake, since the planner is pure."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Stop):
                self.sessions.pop(action.key, None)
            elif isinstance(action, (Start, Recreate)):
                assert action.spec is not None
                self.sessions[action.key] = session_of(action.spec, "running")
            elif isinstance(action, Prepare):
                assert action.spec is not None
                self.sessions[action.key] = session_of(action.spec, "created")
            elif isinstance(action, Extend):
                self.sessions[action.key] = dataclasses.replace(
                    self.sessions[action.key], end=action.end
                )


bookings_strategy = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=24 * 4),  # start, in quarter hours from T0
        st.integers(min_value=1, max_value=16),  # length, in quarter hours
        st.integers(min_value=1, max_value=4),  # GPUs
        st.one_of(st.none(), st.integers(min_value=0, max_value=24 * 4)),  # cancelled at
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(bookings_strategy)
def test_property_no_gpu_shared_and_no_session_outside_its_booking(
    bookings: list[tuple[int, int, int, int | None]],
) -> None:
    quarter = timedelta(minutes=15)
    config: Config = CONFIG
    grace = config.daemon.cancel_grace
    reservations = [
        booking(f"r{index}", start=T0 + start * quarter, hours=length / 4, gpus=gpus)
        for index, (start, length, gpus, _) in enumerate(bookings)
    ]
    cancelled_at = {
        f"r{index}": T0 + when * quarter
        for index, (_, _, _, when) in enumerate(bookings)
        if when is not None
    }
    engine = SimulatedEngine()
    missing_since: dict[str, datetime] = {}
    known = frozenset(reservation.key for reservation in reservations)
    step = timedelta(minutes=5)
    now = T0 - timedelta(minutes=10)
    while now <= T0 + timedelta(hours=30):
        visible = [r for r in reservations if now < cancelled_at.get(r.key, now + step)]
        visible_keys = {reservation.key for reservation in visible}
        for key in engine.sessions:
            if key not in visible_keys:
                missing_since.setdefault(key, now)
        memory = Memory(
            missing_since=dict(missing_since),
            known=known,
            cancel_notified=frozenset(missing_since),
            warnings_sent=frozenset((key, seconds) for key in known for seconds in (900, 300)),
        )
        engine.apply(plan(visible, list(engine.sessions.values()), INVENTORY, now, config, memory))
        live = [session for session in engine.sessions.values() if session.state == "running"]
        held: list[int] = [gpu for session in live for gpu in session.gpu_indices]
        assert len(held) == len(set(held)), f"GPU given twice at {now}: {live}"
        by_key = {reservation.key: reservation for reservation in reservations}
        for session in live:
            reservation = by_key[session.key]
            assert reservation.start <= now < reservation.end
            if session.key in cancelled_at:
                assert now < cancelled_at[session.key] + grace + step
        now += step
