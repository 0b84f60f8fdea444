"""The planner with actions under way, refused ports and changes to running bookings."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from test_plan import CONFIG, INVENTORY, MINUTE, T0, booking, kinds, running

from gpuresa.planning.actions import NotifyChange, Start, Stop
from gpuresa.planning.facts import Memory
from gpuresa.planning.planner import plan


def test_a_key_with_an_action_under_way_gets_no_other_action() -> None:
    reservation = booking("a")
    session = running(reservation)
    # the session has ended, but its last action (say, an extension) still runs
    memory = Memory(in_flight={"a": None})
    assert plan([reservation], [session], INVENTORY, reservation.end, CONFIG, memory) == []
    assert kinds(plan([reservation], [session], INVENTORY, reservation.end, CONFIG)) == [
        ("Stop", "a")
    ]


def test_a_start_under_way_keeps_its_gpus_and_ports_from_the_next_booking() -> None:
    first, second = booking("a", gpus=4), booking("b", gpus=1)
    taking = plan([first], [], INVENTORY, T0, CONFIG)[0]
    assert isinstance(taking, Start) and taking.spec is not None
    # a's containers are not in Docker yet: only the in-flight spec says what it takes
    memory = Memory(in_flight={"a": taking.spec})
    actions = plan([first, second], [], INVENTORY, T0, CONFIG, memory)
    assert kinds(actions) == [("Fail", "b")]
    assert "not free" in actions[0].describe()


def test_a_stop_under_way_frees_its_gpus_but_not_its_ports() -> None:
    ending = booking("a", gpus=4)
    following = booking("b", start=ending.end, gpus=4)
    session = running(ending, (0, 1, 2, 3), port=20000)
    memory = Memory(in_flight={"a": None}, stopping=frozenset({"a"}))
    actions = plan([ending, following], [session], INVENTORY, ending.end, CONFIG, memory)
    assert kinds(actions) == [("Start", "b")]
    start = actions[0]
    assert isinstance(start, Start) and start.spec is not None
    assert start.spec.gpu_indices == (0, 1, 2, 3) and start.spec.ssh_port != 20000


def test_ports_the_engine_refused_are_skipped() -> None:
    memory = Memory(refused_ports=frozenset({20000, 21000}))
    actions = plan([booking("a")], [], INVENTORY, T0, CONFIG, memory)
    start = actions[0]
    assert isinstance(start, Start) and start.spec is not None
    assert (start.spec.ssh_port, start.spec.ftp_port) == (20001, 21001)


def test_a_running_booking_given_to_another_user_stops_then_starts_for_them() -> None:
    reservation = booking("a", user="alice")
    session = running(reservation)
    now = T0 + MINUTE
    given = dataclasses.replace(reservation, user="bob")
    actions = plan([given], [session], INVENTORY, now, CONFIG)
    assert kinds(actions) == [("Stop", "a")]
    assert isinstance(actions[0], Stop) and actions[0].reason == "reassigned"
    # once alice's session is gone, bob's starts on the same booking
    after = plan([given], [], INVENTORY, now + MINUTE, CONFIG)
    assert kinds(after) == [("Start", "a")]
    assert isinstance(after[0], Start) and after[0].spec is not None
    assert after[0].spec.user == "bob"


def test_a_changed_template_or_gpu_count_of_a_running_session_is_told_once() -> None:
    reservation = booking("a", gpus=1)
    session = running(reservation)
    changed = dataclasses.replace(reservation, template="tensorflow", gpus=2)
    actions = plan([changed], [session], INVENTORY, T0 + MINUTE, CONFIG)
    assert kinds(actions) == [("NotifyChange", "a")]
    change = actions[0]
    assert isinstance(change, NotifyChange)
    assert change.change == "template pytorch → tensorflow, GPUs 1 → 2"
    told = Memory(changes_notified=frozenset({("a", change.change)}))
    assert plan([changed], [session], INVENTORY, T0 + MINUTE, CONFIG, told) == []


def test_an_unchanged_running_booking_needs_nothing() -> None:
    reservation = booking("a")
    assert plan([reservation], [running(reservation)], INVENTORY, T0 + MINUTE, CONFIG) == []


def test_an_extension_during_a_stop_under_way_waits_for_it() -> None:
    reservation = booking("a")
    session = running(reservation)
    extended = dataclasses.replace(reservation, end=reservation.end + timedelta(hours=1))
    memory = Memory(in_flight={"a": None}, stopping=frozenset({"a"}))
    assert plan([extended], [session], INVENTORY, T0 + MINUTE, CONFIG, memory) == []
