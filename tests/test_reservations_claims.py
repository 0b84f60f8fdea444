"""Hostile calendar writers: what one writer types cannot take another user's booking."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st
from test_reservations import VARIANTS, WINDOW, event, make_config, seen

from gpuresa.config.sections import Config, parse_config
from gpuresa.model import Reservation
from gpuresa.reservations.claims import moved_key
from gpuresa.reservations.rules import read_calendar, read_reservations, resolve_conflicts

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


# --- the property: granted time is never lost ---------------------------------------------------

HOURS = st.integers(min_value=0, max_value=48)


Case = tuple[list[Reservation], dict[str, tuple[datetime, datetime]], list[Reservation]]


@st.composite
def calendars_and_edits(draw: st.DrawFn) -> Case:
    """Bookings of several logins, what the running ones were granted, and one writer's edits."""
    count = draw(st.integers(min_value=1, max_value=6))
    bookings = []
    for index in range(count):
        start = draw(HOURS)
        length = draw(st.integers(min_value=1, max_value=12))
        user = draw(st.sampled_from(["alice", "bob", "carol"]))
        gpus = draw(st.integers(min_value=1, max_value=4))
        bookings.append(
            booking(
                f"k{index}",
                user,
                DAY + timedelta(hours=start),
                DAY + timedelta(hours=start + length),
                gpus,
            )
        )
    resolved = resolve_conflicts(bookings, make_config(), first_seen={})
    granted = {
        item.key: (item.start, item.end) for item in resolved.reservations if draw(st.booleans())
    }
    edited = []
    for item in bookings:
        if item.user == "mallory" or item.user == "alice":
            # alice edits her own bookings any way she likes
            start = draw(HOURS)
            item = replace(
                item,
                start=DAY + timedelta(hours=start),
                end=DAY + timedelta(hours=start + draw(st.integers(min_value=1, max_value=72))),
                # a granted booking's GPU count is the session's: only its times are edited
                gpus=item.gpus if item.key in granted else draw(st.integers(1, 4)),
            )
        edited.append(item)
    return bookings, granted, edited


@settings(max_examples=300, deadline=None)
@given(calendars_and_edits())
def test_no_other_login_loses_granted_time(case: Case) -> None:
    _, granted, edited = case
    found = resolve_conflicts(edited, make_config(), first_seen={}, granted=granted)
    kept = {item.key: item for item in found.reservations}
    for item in edited:
        if item.key not in granted or item.user == "alice":
            continue
        start, end = granted[item.key]
        assert item.key in kept, found.rejected
        assert kept[item.key].start <= start and kept[item.key].end >= end
    # what is kept never asks for more GPUs than the host has at any instant
    instants = {item.start for item in kept.values()}
    for instant in instants:
        assert sum(i.gpus for i in kept.values() if i.start <= instant < i.end) <= 4
