"""Preemptible sessions in the pure planner: idle GPUs used, given back before a firm booking.

Table tests over `plan` and `wakeups` (no I/O, no clock); the booking rules that
mark a booking preemptible and over-booking's view of one are at the end.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import CONFIG, INVENTORY, T0, booking, kinds, running, session_of

from gpuresa.config.reading import parse_config
from gpuresa.model import Reservation, Session
from gpuresa.planning.actions import Action, NotifyPreempt, Prepare, Start, Stop, Warn
from gpuresa.planning.facts import Inventory, Memory
from gpuresa.planning.free_gpus import describe_gpu, free_gpus
from gpuresa.planning.planner import plan
from gpuresa.planning.preemption import STOP_MARGIN, gone_before
from gpuresa.planning.wakeups import wakeups
from gpuresa.reservations.conflicts import resolve_conflicts
from gpuresa.reservations.rules import read_calendar

MINUTE = timedelta(minutes=1)
GRACE = CONFIG.daemon.stop_grace
NOTICE = CONFIG.daemon.preempt_notice


def soft(key: str, start: datetime = T0, hours: float = 8, gpus: int = 1) -> Reservation:
    return dataclasses.replace(booking(key, start, hours, gpus, user="bob"), preemptible=True)


def soft_running(reservation: Reservation, gpus: tuple[int, ...], port: int = 20001) -> Session:
    session = running(reservation, gpus, port)
    return dataclasses.replace(session, preemptible=True)


def of_kind(actions: list[Action], kind: type[Action]) -> list[Action]:
    return [action for action in actions if isinstance(action, kind)]


def test_the_defaults_tell_ten_minutes_ahead_with_sigusr1_and_start_where_fifteen_fit() -> None:
    daemon = parse_config({"daemon": {"host": "h"}, "hosts": [{"name": "h", "gpus": [0]}]}).daemon
    assert daemon.preempt_notice == timedelta(minutes=10)
    assert daemon.preempt_signal == "SIGUSR1"
    assert daemon.preempt_minimum == timedelta(minutes=15)
    assert gone_before(T0, CONFIG) == T0 - GRACE - STOP_MARGIN


def test_a_preemptible_booking_starts_on_idle_gpus_highest_first() -> None:
    actions = plan([soft("idle", gpus=2)], [], INVENTORY, T0, CONFIG)
    (start,) = of_kind(actions, Start)
    assert isinstance(start, Start) and start.spec is not None
    assert start.spec.gpu_indices == (2, 3) and start.spec.preemptible


def test_a_firm_booking_never_counts_a_preemptible_session_in_its_way() -> None:
    # all four GPUs taken by a preemptible session; a firm booking for two in an hour
    sleeper = soft("sleeper", T0 - MINUTE * 30, hours=8, gpus=4)
    firm = booking("firm", T0 + timedelta(hours=1), hours=2, gpus=2)
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    stop_at = gone_before(firm.start, CONFIG)
    # nothing before the notice is due
    assert (
        kinds(plan([sleeper, firm], sessions, INVENTORY, stop_at - NOTICE - MINUTE, CONFIG)) == []
    )
    # told once, when the notice is due, of when it must be gone
    told = plan([sleeper, firm], sessions, INVENTORY, stop_at - NOTICE, CONFIG)
    assert told == [NotifyPreempt("sleeper", stop_at=stop_at)]
    memory = Memory(preempt_notified={"sleeper": stop_at})
    later = plan([sleeper, firm], sessions, INVENTORY, stop_at - MINUTE, CONFIG, memory)
    assert not of_kind(later, NotifyPreempt) and not of_kind(later, Stop)
    # stopped then, with the grace of any ending session
    stopped = plan([sleeper, firm], sessions, INVENTORY, stop_at, CONFIG, memory)
    assert Stop("sleeper", reason="preempted", grace=GRACE) in stopped
    # the firm booking was prepared on the GPUs it is stopped for, and starts on time
    prepared = plan([sleeper, firm], sessions, INVENTORY, firm.start - MINUTE * 5, CONFIG, memory)
    (prepare,) = of_kind(prepared, Prepare)
    assert isinstance(prepare, Prepare) and prepare.spec is not None
    assert prepare.spec.gpu_indices == (0, 1) and not prepare.spec.preemptible
    firm_session = running(firm, (0, 1), port=20000)
    firm_session = dataclasses.replace(firm_session, state="created")
    at_start = plan([sleeper, firm], [firm_session], INVENTORY, firm.start, CONFIG, memory)
    assert ("Start", "firm") in kinds(at_start)


def test_a_preemptible_session_on_gpus_no_firm_booking_needs_runs_to_its_end() -> None:
    firm = booking("firm", T0 + timedelta(hours=1), hours=2, gpus=2)
    actions = plan([soft("idle", gpus=2), firm], [], INVENTORY, T0, CONFIG)
    (start,) = of_kind(actions, Start)
    assert isinstance(start, Start) and start.spec is not None
    assert start.spec.gpu_indices == (2, 3)
    # running there, it is never told to go: the firm booking takes 0 and 1
    sessions = [soft_running(soft("idle", gpus=2), (2, 3))]
    for minutes in range(0, 8 * 60, 7):
        now = T0 + MINUTE * minutes
        decided = plan([soft("idle", gpus=2), firm], sessions, INVENTORY, now, CONFIG)
        assert not of_kind(decided, NotifyPreempt) and not of_kind(decided, Stop), now


def test_a_preemptible_booking_waits_without_failing_where_nothing_is_idle() -> None:
    firm = booking("firm", T0 - MINUTE, hours=2, gpus=4)
    waiting = soft("waiting", T0, hours=4, gpus=1)
    sessions = [running(firm, (0, 1, 2, 3))]
    assert kinds(plan([firm, waiting], sessions, INVENTORY, T0, CONFIG)) == []
    # the firm session gone, the preemptible one starts
    after = plan([waiting], [], INVENTORY, firm.end, CONFIG)
    assert kinds(after) == [("Start", "waiting")]


def test_a_preemptible_booking_starts_only_where_it_can_run_its_minimum() -> None:
    firm = booking("firm", T0 + MINUTE * 10, hours=1, gpus=4)
    assert kinds(plan([firm, soft("late")], [], INVENTORY, T0, CONFIG)) == []
    # a booking shorter than the minimum that fits whole is served
    short = soft("short", T0, hours=0.1, gpus=1)
    assert kinds(plan([short], [], INVENTORY, T0, CONFIG)) == [("Start", "short")]
    # and a free half hour before the firm booking is enough
    firm_later = dataclasses.replace(firm, start=T0 + MINUTE * 30, end=T0 + MINUTE * 90)
    assert kinds(plan([firm_later, soft("late")], [], INVENTORY, T0, CONFIG)) == [("Start", "late")]


def test_a_walk_in_firm_booking_stops_a_preemptible_session_at_once() -> None:
    sleeper = soft("sleeper", T0 - timedelta(hours=1), hours=8, gpus=4)
    walk_in = booking("walk-in", T0, hours=1, gpus=1)
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    actions = plan([sleeper, walk_in], sessions, INVENTORY, T0, CONFIG)
    assert Stop("sleeper", reason="preempted", grace=GRACE) in actions
    (start,) = of_kind(actions, Start)
    assert isinstance(start, Start) and start.spec is not None
    assert start.spec.gpu_indices == (0,)
    # stops run before starts, and the start waits for the GPUs the stop frees
    assert actions.index(of_kind(actions, Stop)[0]) < actions.index(start)


def test_a_chain_of_walk_ins_takes_the_idle_gpus_in_turn() -> None:
    first = soft("first", T0, hours=1, gpus=2)
    second = soft("second", T0, hours=1, gpus=2)
    third = soft("third", T0, hours=1, gpus=1)
    actions = plan([first, second, third], [], INVENTORY, T0, CONFIG)
    starts = {action.key: action.spec.gpu_indices for action in of_kind(actions, Start)}  # type: ignore[attr-defined]
    assert starts == {"first": (2, 3), "second": (0, 1)}
    # once the first ends, the third gets its GPUs
    sessions = [soft_running(second, (0, 1))]
    later = plan([second, third], sessions, INVENTORY, T0 + MINUTE, CONFIG)
    assert [(a.key, a.spec.gpu_indices) for a in of_kind(later, Start)] == [("third", (3,))]  # type: ignore[attr-defined]


def test_a_preemptible_booking_edited_to_firm_while_it_runs_still_gives_way() -> None:
    edited = booking("edited", T0 - timedelta(hours=1), hours=8, gpus=4)  # now says firm
    was_soft = soft_running(dataclasses.replace(edited, preemptible=True), (0, 1, 2, 3))
    firm = booking("firm", T0, hours=1, gpus=1, user="carol")
    actions = plan([edited, firm], [was_soft], INVENTORY, T0, CONFIG)
    assert Stop("edited", reason="preempted", grace=GRACE) in actions


def test_a_prepared_preemptible_session_that_no_longer_fits_is_removed_and_waits() -> None:
    sleeper = soft("sleeper", T0 + MINUTE * 3, hours=4, gpus=4)
    prepared = dataclasses.replace(soft_running(sleeper, (0, 1, 2, 3)), state="created")
    firm = booking("firm", T0 + MINUTE * 10, hours=1, gpus=1, user="carol")
    actions = plan([sleeper, firm], [prepared], INVENTORY, T0, CONFIG)
    assert Stop("sleeper", reason="replan", grace=timedelta(0)) in actions
    assert not [action for action in of_kind(actions, Start) if action.key == "sleeper"]


def test_an_end_warning_and_a_preemption_in_one_round_leave_only_the_stop() -> None:
    sleeper = soft("sleeper", T0 - timedelta(hours=1), hours=1.2, gpus=4)
    walk_in = booking("walk-in", T0, hours=1, gpus=1)
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    actions = plan([sleeper, walk_in], sessions, INVENTORY, T0, CONFIG)
    assert not [action for action in of_kind(actions, Warn) if action.key == "sleeper"]


def test_the_daemon_wakes_to_tell_and_to_stop_a_preemptible_session() -> None:
    sleeper = soft("sleeper", T0 - MINUTE, hours=8, gpus=4)
    firm = booking("firm", T0 + timedelta(hours=2), hours=1, gpus=1)
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    instants = wakeups([sleeper, firm], sessions, INVENTORY, T0, CONFIG)
    stop_at = gone_before(firm.start, CONFIG)
    assert stop_at in instants and stop_at - NOTICE in instants
    # without a preemptible booking, nothing more than before
    assert stop_at not in wakeups([firm], [], INVENTORY, T0, CONFIG)


def test_hosts_without_gpus_to_place_run_preemptible_bookings_like_any_other() -> None:
    host = dataclasses.replace(CONFIG.host(), gpu_mode="none")
    inventory = Inventory(host, ())
    actions = plan([soft("plain")], [], inventory, T0, CONFIG)
    (start,) = of_kind(actions, Start)
    assert isinstance(start, Start) and start.spec is not None
    assert not start.spec.preemptible and start.spec.gpu_indices == ()


def test_a_preemptible_session_whose_booking_vanished_still_gives_way_in_time() -> None:
    sleeper = soft("sleeper", T0 - timedelta(hours=1), hours=8, gpus=4)
    firm = booking("firm", T0 + timedelta(hours=1), hours=1, gpus=2, user="carol")
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    stop_at = gone_before(firm.start, CONFIG)
    # deleted a minute before it must go: its cancel grace (5 min) would run past the start
    memory = Memory(missing_since={"sleeper": stop_at - MINUTE}, known=frozenset({"sleeper"}))
    actions = plan([firm], sessions, INVENTORY, stop_at, CONFIG, memory)
    assert Stop("sleeper", reason="preempted", grace=GRACE) in actions


def test_a_preemptible_booking_right_after_a_firm_session_is_prepared_once() -> None:
    firm = booking("firm", T0 - timedelta(hours=1), hours=1, gpus=4, user="carol")
    after = soft("after", T0, hours=2, gpus=4)
    sessions = [running(firm, (0, 1, 2, 3))]
    quiet = Memory(warnings_sent=frozenset({("firm", 900), ("firm", 300)}))
    prepared = plan([firm, after], sessions, INVENTORY, T0 - MINUTE * 4, CONFIG, quiet)
    assert kinds(prepared) == [("Prepare", "after")]
    (prepare,) = of_kind(prepared, Prepare)
    assert isinstance(prepare, Prepare) and prepare.spec is not None
    made = dataclasses.replace(soft_running(after, prepare.spec.gpu_indices), state="created")
    # the next round keeps it: the firm session ends before it starts
    again = plan([firm, after], [*sessions, made], INVENTORY, T0 - MINUTE * 3, CONFIG, quiet)
    assert not of_kind(again, Stop)


def test_a_new_stop_time_is_told_again() -> None:
    sleeper = soft("sleeper", T0 - timedelta(hours=1), hours=8, gpus=4)
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    first = booking("first", T0 + timedelta(hours=1), hours=1, gpus=1, user="carol")
    told_of = gone_before(first.start, CONFIG)
    # the firm booking that was told of is gone; an earlier one comes
    sooner = booking("sooner", T0 + MINUTE * 20, hours=1, gpus=1, user="dave")
    memory = Memory(preempt_notified={"sleeper": told_of})
    actions = plan([sleeper, sooner], sessions, INVENTORY, T0 + MINUTE * 15, CONFIG, memory)
    assert NotifyPreempt("sleeper", stop_at=gone_before(sooner.start, CONFIG)) in actions


def test_a_preempted_booking_is_never_started_again() -> None:
    sleeper = soft("sleeper", T0 - timedelta(hours=1), hours=8, gpus=4)
    assert kinds(plan([sleeper], [], INVENTORY, T0, CONFIG)) == [("Start", "sleeper")]
    memory = Memory(preempted=frozenset({"sleeper"}))
    assert kinds(plan([sleeper], [], INVENTORY, T0, CONFIG, memory)) == []


# --- over-booking and the booking's own words ------------------------------------------


def test_a_preemptible_booking_is_kept_and_refuses_no_firm_one() -> None:
    firm = booking("firm", gpus=4)
    sleeper = soft("sleeper", gpus=4)
    later = booking("later", T0 + MINUTE, gpus=1, user="carol")
    found = resolve_conflicts([sleeper, firm, later], CONFIG, first_seen={"sleeper": T0 - MINUTE})
    assert {item.key for item in found.reservations} == {"firm", "sleeper"}
    assert [item.key for item in found.rejected] == ["later"]


def test_a_booking_once_seen_preemptible_stays_so_whatever_it_says_now() -> None:
    firm = booking("firm", gpus=4, user="carol")
    turned = booking("turned", gpus=4)  # written preemptible, edited to firm, seen first
    found = resolve_conflicts(
        [turned, firm],
        CONFIG,
        first_seen={"turned": T0 - timedelta(days=1), "firm": T0 - MINUTE},
        holding={"turned"},
        preemptible={"turned"},
    )
    assert {item.key for item in found.reservations} == {"firm", "turned"}
    (kept,) = [item for item in found.reservations if item.key == "turned"]
    assert kept.preemptible and not found.rejected


EVENT = """BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//test//EN
BEGIN:VEVENT
UID:{uid}
DTSTAMP:20261201T080000Z
DTSTART:20261201T090000Z
DTEND:20261201T110000Z
SUMMARY:alice
DESCRIPTION:{description}
END:VEVENT
END:VCALENDAR
"""


def read(description: str, **calendar: object) -> tuple[list[Reservation], list[str]]:
    config = parse_config(
        {
            "daemon": {"host": "gpu1"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "calendars": [
                {"name": "cal", "url": "/srv/cal.ics", "kind": "ics", "host": "gpu1", **calendar}
            ],
        }
    )
    text = EVENT.format(uid="u1", description=description)
    found = read_calendar(
        config.calendars[0],
        config,
        [("u1.ics", text)],
        T0 - timedelta(days=1),
        T0 + timedelta(days=1),
        variants={"pytorch": ("12.4",)},
    )
    return list(found.reservations), [item.reason for item in found.rejected]


def test_a_booking_says_it_is_preemptible_in_its_description() -> None:
    (item,), _ = read("template: pytorch\\npreemptible: yes")
    assert item.preemptible
    (item,), _ = read("template: pytorch")
    assert not item.preemptible
    kept, reasons = read("template: pytorch\\npreemptible: perhaps")
    assert not kept and "'perhaps' is not yes or no (preemptible)" in reasons[0]


def test_a_preemptible_calendar_makes_every_booking_so_and_refuses_a_no() -> None:
    (item,), _ = read("template: pytorch", preemptible=True)
    assert item.preemptible
    kept, reasons = read("template: pytorch\\npreemptible: no", preemptible=True)
    assert not kept and "'no' refused" in reasons[0]


def test_a_cluster_host_refuses_a_preemptible_booking_with_its_reason() -> None:
    config = parse_config(
        {
            "daemon": {"host": "gpu1"},
            "hosts": [{"name": "gpu1", "engine": "slurm", "ssh_ports": "20000-20009"}],
            "calendars": [{"name": "cal", "url": "/srv/c.ics", "kind": "ics", "host": "gpu1"}],
        }
    )
    text = EVENT.format(uid="u1", description="template: pytorch\\npreemptible: yes")
    found = read_calendar(
        config.calendars[0],
        config,
        [("u1.ics", text)],
        T0 - timedelta(days=1),
        T0 + timedelta(days=1),
        variants={"pytorch": ("12.4",)},
    )
    assert not found.reservations
    assert "scheduler places the GPUs" in found.rejected[0].reason


def test_users_see_a_gpu_under_a_preemptible_session_as_free_for_a_booking() -> None:
    sleeper = soft("sleeper", T0 - timedelta(hours=1), hours=8, gpus=4)
    firm = booking("firm", T0 + timedelta(hours=2), hours=1, gpus=1, user="carol")
    sessions = [soft_running(sleeper, (0, 1, 2, 3))]
    view = free_gpus([sleeper, firm], sessions, (0, 1, 2, 3), T0)
    assert [item.holder for item in view] == [None] * 4
    assert [item.yielding and item.yielding.user for item in view] == ["bob"] * 4
    # the firm booking keeps its GPU from its start, the others stay free
    assert view[0].free_until == firm.start and view[1].free_until is None
    line = describe_gpu(view[0], UTC)
    assert line.startswith("free now, until")
    assert "bob's preemptible session there gives way" in line
    # a preemptible booking without a session holds nothing either
    assert all(item.free_until is None for item in free_gpus([soft("later")], [], (0, 1), T0))


# --- a property: firm bookings run as if no preemptible session existed --------------

ROOMY = parse_config(
    {
        "daemon": {"host": "gpu1", "stop_grace": "30s", "warnings": ["5m"]},
        "hosts": [
            {
                "name": "gpu1",
                "gpus": [0, 1, 2, 3],
                "gpu_mode": "nvidia",
                "ssh_ports": "20000-20099",
                "ftp_ports": "21000-21099",
                "ftp_passive_ports": "30000-30999",
                "ftp_passive_per_session": 10,
            }
        ],
    }
)
ROOMY_INVENTORY = Inventory(ROOMY.host(), (0, 1, 2, 3))


@dataclasses.dataclass
class Timeline:
    """What a simulated host did: each session's start (instant, GPUs), and the notices."""

    started: dict[str, tuple[datetime, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    told: dict[str, datetime] = dataclasses.field(default_factory=dict)
    told_of: dict[str, datetime] = dataclasses.field(default_factory=dict)
    preempted: dict[str, datetime] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)


def simulate(reservations: list[Reservation]) -> Timeline:
    """Run the planner at every instant it asks for, carrying its actions out at once."""
    timeline = Timeline()
    sessions: dict[str, Session] = {}
    keys = frozenset(item.key for item in reservations)
    now, horizon = T0 - MINUTE * 10, T0 + timedelta(hours=40)
    while now <= horizon:
        for _ in range(4):
            memory = Memory(
                known=keys,
                warnings_sent=frozenset((key, 300) for key in keys),
                preempt_notified=dict(timeline.told_of),
                preempted=frozenset(timeline.preempted),
                retry_after={key: horizon + timedelta(days=1) for key in timeline.failed},
            )
            actions = plan(
                reservations, list(sessions.values()), ROOMY_INVENTORY, now, ROOMY, memory
            )
            for action in actions:
                if isinstance(action, Stop):
                    sessions.pop(action.key, None)
                    if action.reason == "preempted":
                        timeline.preempted[action.key] = now
                elif isinstance(action, (Start, Prepare)):
                    assert action.spec is not None
                    state = "running" if isinstance(action, Start) else "created"
                    sessions[action.key] = session_of(action.spec, state)
                    if isinstance(action, Start):
                        timeline.started.setdefault(action.key, (now, action.spec.gpu_indices))
                elif isinstance(action, NotifyPreempt):
                    timeline.told.setdefault(action.key, now)
                    timeline.told_of[action.key] = action.stop_at
                elif type(action).__name__ == "Fail":
                    timeline.failed.add(action.key)
            live = [item for item in sessions.values() if item.state == "running"]
            held = [gpu for item in live for gpu in item.gpu_indices]
            assert len(held) == len(set(held)), f"a GPU given twice at {now}: {live}"
            if not [a for a in actions if isinstance(a, (Start, Stop, Prepare))]:
                break
        later = wakeups(reservations, list(sessions.values()), ROOMY_INVENTORY, now, ROOMY, memory)
        if not later:
            break
        now = later[0]
    return timeline


slots = st.tuples(
    st.integers(min_value=0, max_value=12 * 4),  # start, in quarter hours from T0
    st.integers(min_value=1, max_value=16),  # length, in quarter hours
    st.integers(min_value=1, max_value=4),  # GPUs
)


@settings(max_examples=150, deadline=None)
@given(st.lists(slots, max_size=6), st.lists(slots, max_size=4))
def test_property_firm_bookings_start_as_without_preemptible_ones_which_are_told_first(
    firm_slots: list[tuple[int, int, int]], soft_slots: list[tuple[int, int, int]]
) -> None:
    quarter = timedelta(minutes=15)
    firm = [
        booking(f"f{index}", T0 + start * quarter, length / 4, gpus)
        for index, (start, length, gpus) in enumerate(firm_slots)
    ]
    firm = list(resolve_conflicts(firm, ROOMY).reservations)
    idle = [
        soft(f"p{index}", T0 + start * quarter, length / 4, gpus)
        for index, (start, length, gpus) in enumerate(soft_slots)
    ]
    alone = simulate(firm)
    shared = simulate(firm + idle)
    for reservation in firm:
        assert shared.started.get(reservation.key) == alone.started.get(reservation.key)
    assert shared.failed <= alone.failed | {item.key for item in idle}
    notice = ROOMY.daemon.preempt_notice
    for key, stopped in shared.preempted.items():
        # told the whole notice ahead: every booking here was known hours before
        assert key in shared.told and shared.told[key] <= stopped - notice, key
        assert shared.started[key][0] < stopped
        # and its stop, grace and removal were over before a firm session on its GPUs began
        gpus = set(shared.started[key][1])
        for reservation in firm:
            began = shared.started.get(reservation.key)
            if began is not None and gpus & set(began[1]) and stopped <= began[0]:
                assert stopped <= began[0] - ROOMY.daemon.stop_grace - STOP_MARGIN, key
