"""Hostile calendar writers: what one writer types cannot take another user's booking."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from test_reservations import VARIANTS, WINDOW, event, make_config, seen

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import Reservation, Session
from gpuresa.planning.actions import Prepare, Recreate, Start
from gpuresa.planning.facts import Inventory, Memory
from gpuresa.planning.planner import plan
from gpuresa.reservations.claims import moved_key
from gpuresa.reservations.conflicts import resolve_conflicts
from gpuresa.reservations.rules import read_calendar, read_reservations

DAY = datetime(2026, 3, 10, tzinfo=UTC)


def booking(key: str, user: str, start: datetime, end: datetime, gpus: int = 4) -> Reservation:
    return Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar="lab",
        host="gpu1",
        user=user,
        template="pytorch",
        cuda="12.4",
        gpus=gpus,
        start=start,
        end=end,
    )


def test_growing_a_running_booking_over_another_refuses_the_growth_not_the_other() -> None:
    alice = booking("alice", "alice", DAY, DAY + timedelta(hours=2))
    bob = booking(
        "bob", "bob", DAY + timedelta(days=1, hours=10), DAY + timedelta(days=1, hours=12)
    )
    grown = replace(alice, end=DAY + timedelta(days=3))
    found = resolve_conflicts(
        [grown, bob],
        make_config(),
        first_seen=seen(alice=1, bob=2),
        holding=frozenset({"alice"}),
        granted={"alice": (alice.start, alice.end)},
    )
    assert [(item.key, item.end) for item in found.reservations] == [
        ("alice", alice.end),
        ("bob", bob.end),
    ]
    assert [item.key for item in found.rejected] == ["alice/growth"]
    assert found.rejected[0].user == "alice"
    assert "is not taken" in found.rejected[0].reason
    # a growth over free time is taken; shortening always is
    free = replace(alice, end=DAY + timedelta(hours=5))
    shorter = replace(alice, end=DAY + timedelta(hours=1))
    for wanted in (free, shorter):
        found = resolve_conflicts(
            [wanted, bob], make_config(), granted={"alice": (alice.start, alice.end)}
        )
        assert found.reservations[0] == wanted and found.rejected == ()


def test_raising_the_gpus_of_a_running_booking_refuses_the_raise_not_the_other() -> None:
    alice = booking("alice", "alice", DAY, DAY + timedelta(hours=4), gpus=2)
    bob = booking("bob", "bob", DAY + timedelta(hours=1), DAY + timedelta(hours=3), gpus=2)
    raised = replace(alice, gpus=4)
    found = resolve_conflicts(
        [raised, bob],
        make_config(),
        first_seen=seen(alice=1, bob=2),
        holding=frozenset({"alice"}),
        granted={"alice": (alice.start, alice.end)},
        granted_gpus={"alice": 2},
    )
    assert [(item.key, item.gpus) for item in found.reservations] == [("alice", 2), ("bob", 2)]
    [refused] = found.rejected
    assert (refused.key, refused.user) == ("alice/growth", "alice")
    assert "with 4 GPU(s) is not taken" in refused.reason
    assert "keeps" in refused.reason and "with 2 GPU(s)" in refused.reason
    # a raise into free GPUs is taken (the planner tells the user a running session
    # keeps its GPUs); a later booking of another login still comes before it
    alone = resolve_conflicts(
        [raised], make_config(), granted={"alice": (alice.start, alice.end)},
        granted_gpus={"alice": 2},
    )  # fmt: skip
    assert [item.gpus for item in alone.reservations] == [4] and alone.rejected == ()


def test_a_running_booking_that_asks_fewer_gpus_still_counts_those_it_holds() -> None:
    alice = booking("alice", "alice", DAY, DAY + timedelta(hours=4), gpus=3)
    bob = booking("bob", "bob", DAY + timedelta(hours=1), DAY + timedelta(hours=3), gpus=2)
    found = resolve_conflicts(
        [replace(alice, gpus=1), bob],
        make_config(),
        first_seen=seen(alice=1, bob=2),
        holding=frozenset({"alice"}),
        granted={"alice": (alice.start, alice.end)},
        granted_gpus={"alice": 3},
    )
    # the session keeps its 3 GPUs whatever the booking says: bob's 2 do not fit beside them
    assert [(item.key, item.gpus) for item in found.reservations] == [("alice", 1)]
    assert [item.key for item in found.rejected] == ["bob"]


def test_an_ended_booking_moved_over_a_running_session_is_a_new_booking_that_loses() -> None:
    config = make_config({"name": "lab", "url": "/lab", "kind": "ics", "host": "gpu1"})
    old_start = datetime(2025, 12, 1, 8, tzinfo=UTC)
    old = event("mallory", "template: pytorch\\ngpus: all", uid="mallory-old", start=old_start)
    bob = event("bob", "template: pytorch\\ngpus: 2", uid="bob-1")
    moved = event("mallory", "template: pytorch\\ngpus: all", uid="mallory-old")
    bob_times = (WINDOW[0] + timedelta(days=9, hours=8), WINDOW[0] + timedelta(days=9, hours=10))
    objects = {"lab": [("old.ics", moved), ("bob.ics", bob)]}
    del old
    found = read_reservations(
        config,
        objects,
        *WINDOW,
        variants=VARIANTS,
        first_seen=seen(**{"mallory-old": 1, "bob-1": 9}),
        holding=frozenset({"bob-1", "mallory-old"}),
        granted={"bob-1": bob_times, "mallory-old": (old_start, old_start + timedelta(hours=2))},
        ended={"mallory-old": (old_start, old_start + timedelta(hours=2))},
    )
    assert [item.key for item in found.reservations] == ["bob-1"]
    [refused] = found.rejected
    assert refused.key == moved_key("mallory-old", refused.start, refused.end)  # type: ignore[arg-type]
    assert "already runs" in refused.reason
    # the ended occurrence with its own times stays over: nothing new to run
    same = read_reservations(
        config,
        {"lab": [("old.ics", event("mallory", uid="mallory-old", start=old_start))]},
        old_start - timedelta(days=1),
        old_start + timedelta(days=1),
        variants=VARIANTS,
        ended={"mallory-old": (old_start, old_start + timedelta(hours=2))},
    )
    assert [item.key for item in same.reservations] == ["mallory-old"]


def two_calendars() -> Config:
    return parse_config(
        {
            "daemon": {"host": "gpu1"},
            "reservations": {"timezone": "UTC"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "calendars": [
                {"name": "a", "url": "/a.ics", "kind": "ics", "host": "gpu1"},
                {"name": "b", "url": "/b.ics", "kind": "ics", "host": "gpu1"},
            ],
        }
    )


def test_a_uid_copied_into_a_calendar_listed_first_is_refused() -> None:
    config = two_calendars()
    bob = event("bob", uid="bob-1")
    copy = event("mallory", uid="bob-1")
    found = read_reservations(
        config,
        {"a": [("copy.ics", copy)], "b": [("bob.ics", bob)]},
        *WINDOW,
        variants=VARIANTS,
        origins={"bob-1": ("b", "bob.ics")},
    )
    assert [(item.key, item.user) for item in found.reservations] == [("bob-1", "bob")]
    assert [(item.key, item.user) for item in found.rejected] == [("bob-1/copy/a/bob-1", "mallory")]


def test_a_cancelled_copy_with_a_higher_sequence_in_another_file_cancels_nothing() -> None:
    config = make_config()
    calendar = config.calendars[0]
    bob = event("bob", uid="bob-1")
    cancel = event("bob", uid="bob-1", extra="SEQUENCE:9\r\nSTATUS:CANCELLED")
    objects = [("bob.ics", bob), ("a-cancel.ics", cancel)]
    origins = {"bob-1": (calendar.name, "bob.ics")}
    found = read_calendar(calendar, config, objects, *WINDOW, variants=VARIANTS, origins=origins)
    assert [(item.key, item.user) for item in found.reservations] == [("bob-1", "bob")]
    assert "copy in a-cancel.ics is refused" in found.rejected[0].reason
    # in one feed, a second copy of the event after the first is refused too
    second = cancel.split("VERSION:2.0\r\n", 1)[1].rsplit("END:VCALENDAR", 1)[0]
    feed = bob.replace("END:VCALENDAR", second + "END:VCALENDAR", 1)
    found = read_calendar(calendar, config, [("feed.ics", feed)], *WINDOW, variants=VARIANTS)
    assert [(item.key, item.user) for item in found.reservations] == [("bob-1", "bob")]
    assert "holds the event 'bob-1' twice" in found.rejected[0].reason


def test_an_override_cannot_give_an_occurrence_to_another_login() -> None:
    config = make_config()
    calendar = config.calendars[0]
    series = event("bob", uid="bob-s", extra="RRULE:FREQ=DAILY;COUNT=3")
    override = (
        "BEGIN:VEVENT\r\nUID:bob-s\r\n"
        f"RECURRENCE-ID:{WINDOW[0] + timedelta(days=10):%Y%m%dT%H%M%SZ}\r\n"
        f"DTSTART:{WINDOW[0] + timedelta(days=10):%Y%m%dT%H%M%SZ}\r\nDURATION:PT1H\r\n"
        "SUMMARY:mallory\r\nDESCRIPTION:template: pytorch\r\nEND:VEVENT\r\n"
    )
    feed = series.replace("END:VCALENDAR", override + "END:VCALENDAR")
    found = read_calendar(calendar, config, [("feed.ics", feed)], *WINDOW, variants=VARIANTS)
    assert {item.user for item in found.reservations} == {"bob"}
    assert any("cannot be given to someone else" in item.reason for item in found.rejected)


def test_a_uid_cannot_take_an_internal_key_or_an_occurrence_key() -> None:
    config = make_config()
    calendar = config.calendars[0]
    for uid in ("adhoc-x", "bench:gpu1", "bob-s@20260310T080000Z"):
        found = read_calendar(
            calendar, config, [("a.ics", event(uid=uid))], *WINDOW, variants=VARIANTS
        )
        assert found.reservations == ()
        assert "cannot name a reservation" in found.rejected[0].reason


# --- the property: granted time is never lost, an ended occurrence never runs again ------------

NOW = DAY + timedelta(hours=24)
HOURS = st.integers(min_value=0, max_value=48)
USERS = st.sampled_from(["alice", "bob", "carol"])


@dataclass(frozen=True)
class Case:
    """Bookings as their calendar says them, what the daemon knows of them, one writer's edits."""

    texts: dict[str, str]
    users: dict[str, str]
    granted: dict[str, tuple[datetime, datetime]]
    granted_gpus: dict[str, int]
    ended: dict[str, tuple[datetime, datetime]]
    sessions: list[Session]


def ics(key: str, user: str, start: datetime, end: datetime, gpus: int) -> str:
    hours = (end - start) / timedelta(hours=1)
    return event(user, f"template: pytorch\\ngpus: {gpus}", uid=key, start=start, hours=hours)


def session_of(item: Reservation, gpus: tuple[int, ...], index: int) -> Session:
    return Session(
        key=item.key, user=item.user, host="gpu1", template="pytorch", cuda="12.4",
        gpu_count=len(gpus), gpu_indices=gpus,
        start=item.start, end=item.end, ssh_port=20000 + index, ftp_port=21000 + index,
        ftp_passive_first=22000 + 10 * index, ftp_passive_last=22009 + 10 * index,
        state="running", output_dir=Path("/nonexistent"),
    )  # fmt: skip


@st.composite
def calendars_and_edits(draw: st.DrawFn) -> Case:
    """Bookings of several logins, sessions running and ended, and alice's edits to hers."""
    bookings = []
    for index in range(draw(st.integers(min_value=1, max_value=6))):
        start = DAY + timedelta(hours=draw(HOURS))
        length = timedelta(hours=draw(st.integers(min_value=1, max_value=12)))
        gpus = draw(st.integers(min_value=1, max_value=4))
        bookings.append(booking(f"k{index}", draw(USERS), start, start + length, gpus))
    resolved = resolve_conflicts(bookings, make_config(), first_seen={})
    granted: dict[str, tuple[datetime, datetime]] = {}
    granted_gpus: dict[str, int] = {}
    ended: dict[str, tuple[datetime, datetime]] = {}
    sessions: list[Session] = []
    free = [0, 1, 2, 3]
    for item in resolved.reservations:
        if item.end <= NOW and draw(st.booleans()):
            ended[item.key] = (item.start, item.end)
        elif item.start <= NOW < item.end and draw(st.booleans()):
            # every running session overlaps the others now: their GPUs are disjoint
            indices, free = tuple(free[: item.gpus]), free[item.gpus :]
            sessions.append(session_of(item, indices, len(sessions)))
        else:
            continue
        granted[item.key] = (item.start, item.end)
        granted_gpus[item.key] = item.gpus
    texts = {}
    for item in bookings:
        if item.user == "alice":
            # alice edits her bookings any way she likes: times and GPU count
            start = DAY + timedelta(hours=draw(HOURS))
            length = timedelta(hours=draw(st.integers(min_value=1, max_value=72)))
            item = replace(item, start=start, end=start + length, gpus=draw(st.integers(1, 4)))
        texts[item.key] = ics(item.key, item.user, item.start, item.end, item.gpus)
    users = {item.key: item.user for item in bookings}
    return Case(texts, users, granted, granted_gpus, ended, sessions)


@settings(max_examples=300, deadline=None)
@given(calendars_and_edits())
def test_no_other_login_loses_granted_time_and_no_ended_occurrence_runs_again(
    case: Case,
) -> None:
    config = make_config()
    # what the daemon feeds the reader: the journal's claims, the sessions' grants
    found = read_reservations(
        config,
        {"lab": [(f"{key}.ics", text) for key, text in case.texts.items()]},
        NOW - timedelta(days=7),
        NOW + timedelta(days=30),
        variants=VARIANTS,
        first_seen={key: DAY - timedelta(days=1) for key in case.texts},
        holding=frozenset(case.granted),
        granted=case.granted,
        granted_gpus=case.granted_gpus,
        ended=case.ended,
        origins={key: ("lab", f"{key}.ics") for key in case.texts},
    )
    kept = {item.key: item for item in found.reservations}
    for key, (start, end) in case.granted.items():
        if case.users[key] == "alice":
            continue
        assert key in kept, found.rejected
        assert kept[key].start <= start and kept[key].end >= end
        assert kept[key].gpus >= case.granted_gpus[key]
    # what is kept never needs more GPUs than the host has at any instant: a running
    # session counts the GPUs it holds during the time it was given
    running = {session.key: session for session in case.sessions}
    for instant in {item.start for item in kept.values()}:
        used = 0
        for item in kept.values():
            if item.start <= instant < item.end:
                held = running.get(item.key)
                inside = held is not None and held.start <= instant < held.end
                used += max(item.gpus, held.gpu_count) if inside and held else item.gpus
        assert used <= 4
    # the planner, fed what the daemon feeds it, never starts an ended occurrence again
    actions = plan(
        found.reservations, case.sessions, Inventory(config.hosts[0], (0, 1, 2, 3)), NOW, config,
        Memory(known=frozenset(case.texts)),
    )  # fmt: skip
    for action in actions:
        if isinstance(action, (Start, Prepare, Recreate)):
            assert action.key not in case.ended, action
    # nor stops another login's running session
    for action in actions:
        assert action.key not in running or case.users[action.key] == "alice", action
