"""A calendar that suddenly loses most running bookings is held until the loss is confirmed."""

from __future__ import annotations

from datetime import timedelta

from test_plan import T0, booking

from gpuresa.daemon.vanish import screen

CONFIRM = timedelta(minutes=15)
MINUTE = timedelta(minutes=1)


def test_an_emptied_calendar_keeps_its_running_bookings_until_confirmed() -> None:
    bookings = [booking(name, start=T0 - MINUTE) for name in "abc"]
    with_session = {"a", "b", "c"}
    first = screen(bookings, [], with_session, None, T0, CONFIRM)
    assert first.began and first.hold is not None
    assert {item.key for item in first.reservations} == with_session
    # still empty at the next polls: still held
    second = screen([], [], with_session, first.hold, T0 + 5 * MINUTE, CONFIRM)
    assert not second.began and second.hold is not None
    assert {item.key for item in second.reservations} == with_session
    # the loss lasted the confirmation time: the calendar is believed
    third = screen([], [], with_session, second.hold, T0 + CONFIRM, CONFIRM)
    assert third.confirmed and third.hold is None and third.reservations == ()


def test_bookings_that_come_back_end_the_hold() -> None:
    bookings = [booking(name, start=T0 - MINUTE) for name in "ab"]
    held = screen(bookings, [], {"a", "b"}, None, T0, CONFIRM)
    back = screen([], bookings, {"a", "b"}, held.hold, T0 + MINUTE, CONFIRM)
    assert back.hold is None and not back.confirmed
    assert {item.key for item in back.reservations} == {"a", "b"}


def test_one_cancellation_is_believed_at_once() -> None:
    bookings = [booking(name, start=T0 - MINUTE) for name in "abc"]
    result = screen(bookings, bookings[1:], {"a", "b", "c"}, None, T0, CONFIRM)
    assert result.hold is None and not result.began
    assert [item.key for item in result.reservations] == ["b", "c"]


def test_a_single_running_booking_that_vanishes_is_a_cancellation() -> None:
    only = [booking("a", start=T0 - MINUTE)]
    result = screen(only, [], {"a"}, None, T0, CONFIRM)
    assert result.hold is None and result.reservations == ()


def test_losing_bookings_without_sessions_is_not_held() -> None:
    later = [booking(name, start=T0 + timedelta(days=1)) for name in "abcd"]
    result = screen(later, [], set(), None, T0, CONFIRM)
    assert result.hold is None and result.reservations == ()
