"""What real feeds write beyond the letter of RFC 5545, and how the reader takes it.

Each case is read, or refused with a reason that says what is wrong; the
icalendar project's corpus (test_reservations_reference.py) found most of them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from gpuresa.ical.events import expand
from gpuresa.ical.occurrence import Occurrence, Problem
from gpuresa.ical.text import parse_object

PARIS = ZoneInfo("Europe/Paris")
WINDOW = (datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 5, 1, tzinfo=UTC))


def calendar(*events: str, header: str = "") -> str:
    body = "".join(f"BEGIN:VEVENT\r\n{event.strip()}\r\nEND:VEVENT\r\n" for event in events)
    return f"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:test\r\n{header}{body}END:VCALENDAR\r\n"


def run(text: str) -> tuple[list[Occurrence], list[Problem]]:
    occurrences, problems = expand([("feed.ics", parse_object(text))], *WINDOW, PARIS)
    return sorted(occurrences, key=lambda item: item.start), problems


def times(occurrences: list[Occurrence]) -> list[tuple[str, str]]:
    return [
        (item.start.strftime("%m-%d %H:%M"), item.end.strftime("%m-%d %H:%M"))
        for item in occurrences
    ]


# --- events without UID ---------------------------------------------------------------------

NO_UID = "DTSTAMP:20260301T000000Z\nDTSTART:20260310T080000Z\nDTEND:20260310T100000Z\nSUMMARY:alice"


def test_an_event_without_uid_gets_a_key_derived_from_its_content() -> None:
    occurrences, problems = run(calendar(NO_UID))
    assert problems == []
    [occurrence] = occurrences
    assert occurrence.uid.startswith("derived-") and len(occurrence.uid) == 40
    assert occurrence.component.uid_derived is True
    # the same event downloaded again (a feed writes DTSTAMP anew): the same key
    again, _ = run(calendar(NO_UID.replace("20260301T000000Z", "20260302T120000Z")))
    assert [item.uid for item in again] == [occurrence.uid]
    # another event: another key
    other, _ = run(calendar(NO_UID.replace("alice", "bob")))
    assert other[0].uid != occurrence.uid


def test_an_event_with_uid_keeps_it() -> None:
    occurrences, _ = run(calendar(NO_UID + "\nUID: booking-1 "))
    assert [(item.uid, item.component.uid_derived) for item in occurrences] == [
        ("booking-1", False)
    ]


# --- lines around and inside the calendar -------------------------------------------------


def test_text_after_the_last_end_vcalendar_is_passed_over() -> None:
    text = (
        calendar("UID:a\n" + NO_UID) + "X-COMMENT:Cached from 2022-02-20 - new every 1800sec.\r\n"
    )
    occurrences, problems = run(text)
    assert (times(occurrences), problems) == ([("03-10 08:00", "03-10 10:00")], [])


def test_text_before_the_calendar_is_still_not_icalendar() -> None:
    parsed = parse_object("X-COMMENT:hello\r\n" + calendar("UID:a\n" + NO_UID))
    assert parsed.problem is not None and parsed.problem.startswith("not iCalendar text")


def test_a_fold_after_blank_lines_continues_the_line_as_old_mozilla_wrote_it() -> None:
    text = calendar("UID\r\n\r\n :a\r\nDTSTART\r\n\r\n :20260310T080000Z\r\nDURATION:PT1H")
    occurrences, problems = run(text)
    assert problems == []
    assert [(item.uid, *times([item])[0]) for item in occurrences] == [
        ("a", "03-10 08:00", "03-10 09:00")
    ]


def test_another_apps_broken_extension_line_is_passed_over_but_not_a_gpuresa_one() -> None:
    occurrences, problems = run(calendar("UID:a\n" + NO_UID + "\nX-APPLE-RADIUS=49.913"))
    assert (len(occurrences), problems) == (1, [])
    occurrences, problems = run(calendar("UID:a\n" + NO_UID + "\nX-GPURESA-GPUS=2"))
    assert occurrences == []
    assert [problem.reason for problem in problems] == ["line 10 is not a 'NAME:value' property"]


# --- times ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        # a date beside a date-time: its 00:00 in the date-time's zone
        ("DTSTART;VALUE=DATE:20260310\nDTEND:20260310T120000Z", ("03-10 00:00", "03-10 12:00")),
        (
            "DTSTART;TZID=Europe/Paris:20260310T090000\nDTEND;VALUE=DATE:20260311",
            ("03-10 08:00", "03-10 23:00"),
        ),
    ],
)
def test_dtstart_and_dtend_of_different_kinds_are_read(
    lines: str, expected: tuple[str, str]
) -> None:
    occurrences, problems = run(calendar("UID:a\n" + lines))
    assert (times(occurrences), problems) == ([expected], [])


@pytest.mark.parametrize(
    "tzid",
    [
        "Western/Central Europe",
        '"(UTC+01:00) Brussels, Copenhagen, Madrid, Paris"',
        "(GMT+01.00) Amsterdam / Berlin / Bern / Rome / Stockholm / Vienna",
        "romance standard time",
    ],
)
def test_zone_names_feeds_write_besides_iana_and_windows_ids(tzid: str) -> None:
    # 09:00 in Central European summer time is 07:00 UTC
    occurrences, problems = run(calendar(f"UID:a\nDTSTART;TZID={tzid}:20260415T090000"))
    assert (times(occurrences), problems) == ([("04-15 07:00", "04-15 07:00")], [])


def test_a_zone_name_nothing_defines_is_still_refused() -> None:
    _, problems = run(calendar("UID:a\nDTSTART;TZID=Western/Mars:20260415T090000"))
    assert [problem.reason for problem in problems] == [
        "unknown time zone 'Western/Mars' (no VTIMEZONE defines it)"
    ]


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        (
            "DTSTART:20260310T080000Z\nDTSTART:20260310T100000Z",
            "the event has more than one DTSTART",
        ),
        (
            "DTSTART:20260310T080000Z\nRRULE:FREQ=DAILY;COUNT=2\n"
            "RDATE;VALUE=PERIOD:20260320/20260321",
            "RDATE period '20260320/20260321' must start at a time",
        ),
    ],
)
def test_what_cannot_be_read_is_refused_with_its_reason(lines: str, reason: str) -> None:
    occurrences, problems = run(calendar("UID:a\n" + lines))
    assert (occurrences, [problem.reason for problem in problems]) == ([], [reason])


# --- all-day series ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("until", "last_day"),
    [
        # a date-time UNTIL on a series of dates: a day counts while its 00:00 UTC is not after it
        ("20260304T230000Z", "03-04"),
        ("20260305T000000Z", "03-05"),
        ("20260304T235959Z", "03-04"),
        ("20260304", "03-04"),
    ],
)
def test_an_all_day_series_ends_where_its_until_says(until: str, last_day: str) -> None:
    occurrences, problems = run(
        calendar(f"UID:a\nDTSTART;VALUE=DATE:20260302\nRRULE:FREQ=DAILY;UNTIL={until}")
    )
    assert problems == []
    # all-day: 00:00 to 00:00 in Paris, 23:00 UTC the day before
    assert [item.end.strftime("%m-%d") for item in occurrences][-1] == last_day
    assert len(occurrences) == int(last_day[-2:]) - 1


def test_this_and_future_moves_the_later_days_of_an_all_day_series() -> None:
    occurrences, problems = run(
        calendar(
            "UID:a\nDTSTART;VALUE=DATE:20260302\nRRULE:FREQ=DAILY;COUNT=5",
            "UID:a\nRECURRENCE-ID;RANGE=THISANDFUTURE;VALUE=DATE:20260304\n"
            "DTSTART;VALUE=DATE:20260305\nDTEND;VALUE=DATE:20260307",
        )
    )
    assert problems == []
    # each is 00:00 to 00:00 Paris (23:00 UTC the day before); from the 4th on: a day
    # later, and two days long
    assert [(item.recurrence_id, *times([item])[0]) for item in occurrences] == [
        ("20260302", "03-01 23:00", "03-02 23:00"),
        ("20260303", "03-02 23:00", "03-03 23:00"),
        ("20260304", "03-04 23:00", "03-06 23:00"),
        ("20260305", "03-05 23:00", "03-07 23:00"),
        ("20260306", "03-06 23:00", "03-08 23:00"),
    ]
