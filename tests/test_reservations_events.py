"""The iCalendar reader and recurrence expansion (gpuresa.ical.events), case by case.

The recurrence engine is also checked against dateutil's rrule (Hypothesis),
and its work limits against rules crafted to make an expansion spin.
"""

from __future__ import annotations

import time as clock
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from dateutil import rrule as dateutil_rrule
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpuresa.errors import EventError
from gpuresa.ical.events import expand
from gpuresa.ical.occurrence import Occurrence, Problem
from gpuresa.ical.recurrence import MAX_OCCURRENCES_IN_WINDOW, Rule, expand_rule, read_rule
from gpuresa.ical.text import parse_object
from gpuresa.ical.values import read_duration

PARIS = ZoneInfo("Europe/Paris")
WINDOW = (datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 5, 1, tzinfo=UTC))


def calendar(*events: str, header: str = "") -> str:
    body = "".join(f"BEGIN:VEVENT\r\n{event.strip()}\r\nEND:VEVENT\r\n" for event in events)
    return f"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:test\r\n{header}{body}END:VCALENDAR\r\n"


def run(
    *texts: str | bytes,
    window: tuple[datetime, datetime] = WINDOW,
    zone: ZoneInfo = PARIS,
) -> tuple[list[Occurrence], list[Problem]]:
    objects = [(f"object-{index}.ics", parse_object(text)) for index, text in enumerate(texts)]
    occurrences, problems = expand(objects, window[0], window[1], zone)
    return sorted(occurrences, key=lambda item: (item.start, item.uid)), problems


def times(occurrences: list[Occurrence]) -> list[tuple[str | None, str, str]]:
    return [
        (item.recurrence_id, item.start.strftime("%m-%d %H:%M"), item.end.strftime("%m-%d %H:%M"))
        for item in occurrences
    ]


# --- reading the text -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not iCalendar text"),
        ("BEGIN:VCARD\r\nFN:Alice\r\nEND:VCARD\r\n", "expected BEGIN:VCALENDAR"),
        ("BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nEND:VTODO\r\nEND:VCALENDAR\r\n", "END:VTODO inside"),
        ("BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nUID:x\r\n", "ends inside VEVENT"),
        ("", "the object is empty"),
        ("END:VCALENDAR\r\n", "END:VCALENDAR inside nothing"),
    ],
)
def test_an_object_that_is_not_icalendar_is_one_problem(text: str | bytes, fragment: str) -> None:
    parsed = parse_object(text)
    assert parsed.events == ()
    assert parsed.problem is not None and fragment in parsed.problem


def test_a_broken_line_spoils_only_its_event() -> None:
    text = calendar(
        "UID:good\r\nDTSTART:20260310T080000Z\r\nDTEND:20260310T090000Z",
        "UID:bad\r\nDTSTART:20260311T080000Z\r\nthis line has no colon\r\nDTEND:20260311T090000Z",
    )
    occurrences, problems = run(text)
    assert [item.uid for item in occurrences] == ["good"]
    assert [(problem.uid, problem.reason) for problem in problems] == [
        ("bad", "line 12 is not a 'NAME:value' property")
    ]


def test_lf_lines_lower_case_names_bom_tab_folding_and_quoted_colons() -> None:
    text = (
        "\ufeffbegin:vcalendar\nversion:2.0\nbegin:vevent\nuid:folded-\n\tuid\n"
        'organizer;cn="Doe: J; Jr":mailto:jdoe@example.org\n'
        'description;altrep="http://example.org/a:b":template: pytorch\n'
        "dtstart;tzid=Europe/Paris:20260310T090000\nduration:PT1H\nend:vevent\nend:vcalendar\n"
    )
    occurrences, problems = run(text.encode("utf-8"))
    assert problems == []
    [occurrence] = occurrences
    assert occurrence.uid == "folded-uid"
    organizer = occurrence.component.first("ORGANIZER")
    assert organizer is not None
    assert organizer.value == "mailto:jdoe@example.org"
    assert organizer.parameter("CN") == "Doe: J; Jr"
    assert occurrence.component.text("DESCRIPTION") == "template: pytorch"
    assert (occurrence.start, occurrence.end) == (
        datetime(2026, 3, 10, 8, tzinfo=UTC),
        datetime(2026, 3, 10, 9, tzinfo=UTC),
    )


def test_text_escapes_are_undone() -> None:
    text = calendar(r"UID:x\, y" + "\r\nDTSTART:20260310T080000Z\r\nSUMMARY:a\\, b\\; c\\\\d\\ne")
    occurrences, _ = run(text)
    assert occurrences[0].component.text("SUMMARY") == "a, b; c\\d\ne"


# --- time -------------------------------------------------------------------------------------


def test_windows_zone_name_without_vtimezone() -> None:
    text = calendar(
        "UID:w\r\nDTSTART;TZID=W. Europe Standard Time:20260310T090000\r\n"
        "DTEND;TZID=W. Europe Standard Time:20260310T100000"
    )
    occurrences, problems = run(text)
    assert problems == []
    assert occurrences[0].start == datetime(2026, 3, 10, 8, tzinfo=UTC)


def test_unknown_zone_and_unreadable_vtimezone_are_rejected() -> None:
    broken_zone = (
        "BEGIN:VTIMEZONE\r\nTZID:Lab Time\r\nBEGIN:STANDARD\r\nDTSTART:nonsense\r\n"
        "TZOFFSETFROM:+0100\r\nTZOFFSETTO:+0100\r\nEND:STANDARD\r\nEND:VTIMEZONE\r\n"
    )
    text = calendar(
        "UID:a\r\nDTSTART;TZID=Lab Time:20260310T090000",
        "UID:b\r\nDTSTART;TZID=Nowhere/City:20260310T090000",
        header=broken_zone,
    )
    _, problems = run(text)
    assert sorted((problem.uid, problem.reason) for problem in problems) == [
        ("a", "the time zone 'Lab Time' is defined in a way that cannot be read"),
        ("b", "unknown time zone 'Nowhere/City' (no VTIMEZONE defines it)"),
    ]


@pytest.mark.parametrize("spelling", [str.upper, str.lower])
def test_a_custom_zone_is_built_from_its_vtimezone_however_spelled(
    spelling: Callable[[str], str],
) -> None:
    definition = (
        "BEGIN:VTIMEZONE\r\nTZID:Lab Time\r\nBEGIN:STANDARD\r\nDTSTART:16010101T000000\r\n"
        "TZOFFSETFROM:+0530\r\nTZOFFSETTO:+0530\r\nEND:STANDARD\r\nEND:VTIMEZONE\r\n"
    )
    # names and BEGIN/END keywords in either case; values are kept as written

    def respell(line: str) -> str:
        name, _, value = line.partition(":")
        return f"{spelling(name)}:{spelling(value) if name in ('BEGIN', 'END') else value}"

    header = "\r\n".join(respell(line) for line in definition.split("\r\n") if line) + "\r\n"
    text = calendar("UID:lab\r\nDTSTART;TZID=Lab Time:20260310T090000", header=header)
    occurrences, problems = run(text)
    assert problems == []
    assert occurrences[0].start == datetime(2026, 3, 10, 3, 30, tzinfo=UTC)


def test_floating_times_use_x_wr_timezone_else_the_site_zone() -> None:
    event = "UID:f\r\nDTSTART:20260310T090000\r\nDTEND:20260310T100000"
    in_new_york, _ = run(calendar(event, header="X-WR-TIMEZONE:America/New_York\r\n"))
    in_paris, _ = run(calendar(event))
    in_utc, _ = run(calendar(event), zone=ZoneInfo("UTC"))
    assert in_new_york[0].start == datetime(2026, 3, 10, 13, tzinfo=UTC)  # EDT since 03-08
    assert in_paris[0].start == datetime(2026, 3, 10, 8, tzinfo=UTC)
    assert in_utc[0].start == datetime(2026, 3, 10, 9, tzinfo=UTC)


def test_times_in_the_dst_gap_move_forward_and_ambiguous_times_take_the_first() -> None:
    text = calendar(
        # 02:30 does not exist in Paris on 2026-03-29: it is 03:30 CEST (RFC 5545)
        "UID:gap\r\nDTSTART;TZID=Europe/Paris:20260329T023000\r\nDURATION:PT1H",
        # 02:30 happens twice on 2026-10-25: the first (CEST)
        "UID:twice\r\nDTSTART;TZID=Europe/Paris:20261025T023000\r\nDURATION:PT1H",
    )
    occurrences, _ = run(text, window=(WINDOW[0], datetime(2026, 11, 1, tzinfo=UTC)))
    starts = {item.uid: item.start for item in occurrences}
    assert starts == {
        "gap": datetime(2026, 3, 29, 1, 30, tzinfo=UTC),
        "twice": datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
    }


def test_all_day_events_run_from_midnight_to_midnight_in_the_site_zone() -> None:
    text = calendar(
        "UID:day\r\nDTSTART;VALUE=DATE:20260329",  # no DTEND: one day (23 hours here)
        "UID:days\r\nDTSTART;VALUE=DATE:20260310\r\nDURATION:P2D",
    )
    occurrences, _ = run(text)
    assert times(occurrences) == [
        (None, "03-09 23:00", "03-11 23:00"),
        (None, "03-28 23:00", "03-29 22:00"),
    ]


@pytest.mark.parametrize(
    ("text", "days", "seconds"),
    [("PT2H30M", 0, 9000), ("P1D", 1, 0), ("P1W", 7, 0), ("-PT15M", 0, -900), ("P1DT1S", 1, 1)],
)
def test_durations(text: str, days: int, seconds: int) -> None:
    assert read_duration(text) == (days, seconds)


@pytest.mark.parametrize("text", ["P", "PT", "1H", "P1Y", "PT1.5H", "P99999999D", ""])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(EventError):
        read_duration(text)


def test_a_day_long_duration_follows_the_wall_clock_across_dst() -> None:
    # P1D from 12:00 on the day before DST: 12:00 the next day, 23 hours later
    text = calendar("UID:d\r\nDTSTART;TZID=Europe/Paris:20260328T120000\r\nDURATION:P1D")
    occurrences, _ = run(text)
    assert occurrences[0].end - occurrences[0].start == timedelta(hours=23)


# --- recurrence ---------------------------------------------------------------------------


def series(rule: str, extra: str = "", start: str = "20260302T090000") -> str:
    return calendar(
        f"UID:s\r\nDTSTART;TZID=Europe/Paris:{start}\r\nDURATION:PT1H\r\nRRULE:{rule}\r\n{extra}"
    )


def test_rdate_exdate_and_periods() -> None:
    text = series(
        "FREQ=WEEKLY;COUNT=3",
        "RDATE;TZID=Europe/Paris:20260304T150000,20260305T150000\r\n"
        "RDATE;VALUE=PERIOD:20260306T100000Z/PT3H\r\n"
        "EXDATE;TZID=Europe/Paris:20260309T090000\r\n"
        "EXDATE;VALUE=DATE:20260305",
    )
    occurrences, problems = run(text)
    assert problems == []
    assert times(occurrences) == [
        ("20260302T080000Z", "03-02 08:00", "03-02 09:00"),
        ("20260304T140000Z", "03-04 14:00", "03-04 15:00"),
        # the period keeps its own length
        ("20260306T100000Z", "03-06 10:00", "03-06 13:00"),
        ("20260316T080000Z", "03-16 08:00", "03-16 09:00"),
    ]


def test_an_occurrence_moved_into_the_window_from_outside_counts_once() -> None:
    text = calendar(
        "UID:m\r\nDTSTART:20260223T090000Z\r\nDTEND:20260223T100000Z\r\nRRULE:FREQ=WEEKLY;COUNT=3",
        # 02-23 (before the window) moved to 03-04; 03-02 moved out, to June
        "UID:m\r\nRECURRENCE-ID:20260223T090000Z\r\nDTSTART:20260304T090000Z\r\n"
        "DTEND:20260304T100000Z",
        "UID:m\r\nRECURRENCE-ID:20260302T090000Z\r\nDTSTART:20260602T090000Z\r\n"
        "DTEND:20260602T100000Z",
    )
    occurrences, _ = run(text)
    assert times(occurrences) == [
        ("20260223T090000Z", "03-04 09:00", "03-04 10:00"),
        ("20260309T090000Z", "03-09 09:00", "03-09 10:00"),
    ]


def test_this_and_future_override_moves_the_rest_of_the_series() -> None:
    text = calendar(
        "UID:t\r\nDTSTART:20260302T090000Z\r\nDTEND:20260302T100000Z\r\nRRULE:FREQ=WEEKLY;COUNT=4",
        "UID:t\r\nRECURRENCE-ID;RANGE=THISANDFUTURE:20260316T090000Z\r\n"
        "DTSTART:20260316T140000Z\r\nDTEND:20260316T160000Z\r\nSUMMARY:later",
    )
    occurrences, _ = run(text)
    assert times(occurrences) == [
        ("20260302T090000Z", "03-02 09:00", "03-02 10:00"),
        ("20260309T090000Z", "03-09 09:00", "03-09 10:00"),
        ("20260316T090000Z", "03-16 14:00", "03-16 16:00"),
        ("20260323T090000Z", "03-23 14:00", "03-23 16:00"),
    ]
    assert occurrences[-1].component.text("SUMMARY") == "later"


def test_a_cancelled_series_cancels_everything_and_a_cancelled_override_one() -> None:
    cancelled_series = calendar(
        "UID:c\r\nSTATUS:CANCELLED\r\nDTSTART:20260302T090000Z\r\nRRULE:FREQ=DAILY;COUNT=3",
        "UID:c\r\nRECURRENCE-ID:20260303T090000Z\r\nDTSTART:20260303T120000Z",
    )
    assert run(cancelled_series) == ([], [])
    one_cancelled = calendar(
        "UID:o\r\nDTSTART:20260302T090000Z\r\nDURATION:PT1H\r\nRRULE:FREQ=DAILY;COUNT=3",
        "UID:o\r\nRECURRENCE-ID:20260303T090000Z\r\nSTATUS:CANCELLED",
    )
    occurrences, _ = run(one_cancelled)
    assert [item.recurrence_id for item in occurrences] == ["20260302T090000Z", "20260304T090000Z"]


def test_of_two_revisions_of_an_event_the_newer_counts() -> None:
    older = calendar("UID:r\r\nSEQUENCE:1\r\nDTSTART:20260310T090000Z\r\nDURATION:PT1H")
    newer = calendar("UID:r\r\nSEQUENCE:2\r\nDTSTART:20260311T090000Z\r\nDURATION:PT1H")
    occurrences, _ = run(newer, older)
    assert times(occurrences) == [(None, "03-11 09:00", "03-11 10:00")]


def test_dtstart_is_the_first_instance_and_counts_towards_count() -> None:
    # DTSTART on a Monday, the rule says Wednesdays: Monday, then two Wednesdays
    occurrences, _ = run(series("FREQ=WEEKLY;BYDAY=WE;COUNT=3"))
    assert [item.start.strftime("%a %d") for item in occurrences] == ["Mon 02", "Wed 04", "Wed 11"]


@pytest.mark.parametrize(
    ("rule", "start", "expected"),
    [
        # the 31st: months without one have no occurrence
        ("FREQ=MONTHLY;BYMONTHDAY=31;COUNT=3", "20260131T090000", ["03-31"]),
        ("FREQ=MONTHLY;BYMONTHDAY=-1;COUNT=4", "20260131T090000", ["03-31", "04-30"]),
        # the last weekday of the month
        ("FREQ=MONTHLY;BYDAY=MO,TU,WE,TH,FR;BYSETPOS=-1;COUNT=4", "20260130T090000",
         ["03-31", "04-30"]),
        ("FREQ=MONTHLY;BYDAY=2TU,-1FR;UNTIL=20260430T000000Z", "20260301T090000",
         ["03-01", "03-10", "03-27", "04-14", "04-24"]),
        ("FREQ=YEARLY;BYMONTH=3,4;BYDAY=1MO", "20250303T090000", ["03-02", "04-06"]),
        ("FREQ=DAILY;INTERVAL=10;BYDAY=MO", "20260302T090000", ["03-02", "03-12"][:1]),
        ("FREQ=WEEKLY;INTERVAL=2;BYDAY=TU,TH;WKST=SU", "20260303T090000",
         ["03-03", "03-05", "03-17", "03-19", "03-31", "04-02", "04-14", "04-16", "04-28",
          "04-30"]),
        # RFC 5545: BYDAY lists are unions, numbered or not (dateutil intersects these)
        ("FREQ=MONTHLY;BYDAY=1MO,FR;UNTIL=20260410T000000Z", "20260301T090000",
         ["03-01", "03-02", "03-06", "03-13", "03-20", "03-27", "04-03", "04-06"]),
        ("FREQ=DAILY;BYHOUR=9,15;BYMINUTE=30;COUNT=3", "20260302T093000",
         ["03-02", "03-02", "03-03"]),
    ],
)  # fmt: skip
def test_rules(rule: str, start: str, expected: list[str]) -> None:
    occurrences, problems = run(series(rule, start=start))
    assert problems == []
    assert [item.start.strftime("%m-%d") for item in occurrences] == expected


def test_a_series_from_decades_ago_costs_only_its_window() -> None:
    began = clock.perf_counter()
    occurrences, _ = run(series("FREQ=DAILY", start="19700101T090000"))
    assert clock.perf_counter() - began < 1.0
    assert len(occurrences) == 61  # every day of March and April 2026
    assert occurrences[0].recurrence_id == "20260301T080000Z"


@pytest.mark.parametrize(
    "rule",
    [
        "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30",
        "FREQ=WEEKLY;BYMONTH=2;BYDAY=MO;INTERVAL=7;BYSETPOS=5",
        "FREQ=MONTHLY;BYMONTHDAY=30;BYMONTH=2",
        "FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=30",
        "FREQ=DAILY;INTERVAL=7;BYDAY=TU",  # Mondays only, by the interval
    ],
)
def test_rules_that_never_match_cost_little(rule: str) -> None:
    # dateutil's rrule needs up to 10 s to find out (it counts up to the year 9999)
    began = clock.perf_counter()
    occurrences, problems = run(series(rule, start="19900101T090000"))
    assert clock.perf_counter() - began < 1.0
    assert occurrences == [] and problems == []


def test_a_count_series_starting_far_too_early_is_refused_not_expanded() -> None:
    _, problems = run(series("FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30;COUNT=5", start="17000101T090000"))
    assert "repetitions or more before the window" in problems[0].reason


def test_too_many_occurrences_in_the_window_are_refused() -> None:
    minutes = ",".join(str(minute) for minute in range(0, 60, 5))
    _, problems = run(series(f"FREQ=DAILY;BYHOUR=8,9,10,11,12,13;BYMINUTE={minutes}"))
    assert problems[0].reason == (
        f"the series has more than {MAX_OCCURRENCES_IN_WINDOW} occurrences in the window"
    )


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        ("FREQ=HOURLY", "RRULE repeats hourly; a booking repeats at most daily"),
        ("FREQ=FORTNIGHTLY", "RRULE FREQ=FORTNIGHTLY is not a frequency"),
        ("COUNT=3", "RRULE has no FREQ"),
        ("FREQ=DAILY;BYYEARDAY=100", "RRULE BYYEARDAY is not supported (no booking app writes it)"),
        ("FREQ=DAILY;COUNT=2;UNTIL=20260401T000000Z", "RRULE has both COUNT and UNTIL"),
        ("FREQ=WEEKLY;BYDAY=2MO", "RRULE BYDAY with a number only fits MONTHLY or YEARLY"),
        ("FREQ=MONTHLY;BYDAY=6MO", "RRULE BYDAY: a month has at most 5 of each weekday"),
        ("FREQ=DAILY;INTERVAL=0", "RRULE INTERVAL=0: 0 is out of range"),
        ("FREQ=DAILY;BYMONTH=13", "RRULE BYMONTH=13: 13 is out of range"),
        ("FREQ=DAILY;BYDAY=XX", "RRULE BYDAY=XX is not a list of weekdays"),
        ("FREQ=DAILY;FREQ=WEEKLY", "RRULE names FREQ twice"),
        ("FREQ=DAILY;UNTIL=soon", "UNTIL 'SOON' is not a date or a date-time"),
        ("FREQ=DAILY;COLOR=red", "RRULE part COLOR is not known"),
    ],
)
def test_rules_that_are_refused_with_their_reason(rule: str, reason: str) -> None:
    _, problems = run(series(rule))
    assert [problem.reason for problem in problems] == [reason]


# --- the engine against dateutil -------------------------------------------------------------

WEEKDAYS = [dateutil_rrule.MO, dateutil_rrule.TU, dateutil_rrule.WE, dateutil_rrule.TH,
            dateutil_rrule.FR, dateutil_rrule.SA, dateutil_rrule.SU]  # fmt: skip
FREQUENCIES: dict[str, Any] = {"DAILY": dateutil_rrule.DAILY, "WEEKLY": dateutil_rrule.WEEKLY,
               "MONTHLY": dateutil_rrule.MONTHLY, "YEARLY": dateutil_rrule.YEARLY}  # fmt: skip


@st.composite
def rules(draw: st.DrawFn) -> tuple[Rule, datetime]:
    """Rules booking apps could write, kept to ones that match now and then (dateutil
    would spin on the others)."""
    frequency = draw(st.sampled_from(list(FREQUENCIES)))
    start = draw(st.datetimes(datetime(2024, 1, 1), datetime(2027, 1, 1))).replace(microsecond=0)
    by_month = tuple(draw(st.sets(st.integers(1, 12), max_size=3)))
    by_month_day: tuple[int, ...] = ()
    by_day: tuple[tuple[int, int], ...] = ()
    if frequency != "WEEKLY" and draw(st.booleans()):
        by_month_day = tuple(
            draw(st.sets(st.integers(-28, 28).filter(bool), min_size=1, max_size=3))
        )
    if draw(st.booleans()):
        ordinals = st.just(0)
        if frequency in ("MONTHLY", "YEARLY") and not by_month_day and draw(st.booleans()):
            # numbered weekdays only: with a mix such as BYDAY=1MO,MO dateutil keeps the
            # days both kinds pick (the first Monday), where RFC 5545 lists both (every Monday)
            ordinals = st.sampled_from([1, 2, -1, 4])
        by_day = tuple(
            draw(st.sets(st.tuples(ordinals, st.integers(0, 6)), min_size=1, max_size=3))
        )
    by_hour = tuple(draw(st.sets(st.integers(0, 23), max_size=2)))
    by_set_position: tuple[int, ...] = ()
    if draw(st.booleans()) and (by_day or by_month_day or by_hour):
        by_set_position = (draw(st.sampled_from([1, -1])),)
    ending = draw(st.sampled_from(["none", "count", "until"]))
    rule = Rule(
        frequency=frequency,
        interval=draw(st.integers(1, 3)),
        count=draw(st.integers(1, 40)) if ending == "count" else None,
        until=start + timedelta(days=draw(st.integers(0, 900))) if ending == "until" else None,
        by_month=by_month,
        by_month_day=by_month_day,
        by_day=by_day,
        by_hour=by_hour,
        by_set_position=by_set_position,
        week_start=draw(st.integers(0, 6)),
    )
    return rule, start


def dateutil_instances(
    rule: Rule, start: datetime, low: datetime, high: datetime
) -> list[datetime]:
    weekdays = [
        WEEKDAYS[day](ordinal) if ordinal else WEEKDAYS[day] for ordinal, day in rule.by_day
    ]
    until = min(rule.until, high) if rule.until is not None else high
    built = dateutil_rrule.rrule(
        FREQUENCIES[rule.frequency],
        dtstart=start,
        interval=rule.interval,
        count=rule.count,
        until=None if rule.count is not None else until,
        bymonth=rule.by_month or None,
        bymonthday=rule.by_month_day or None,
        byweekday=weekdays or None,
        byhour=rule.by_hour or None,
        bysetpos=rule.by_set_position or None,
        wkst=rule.week_start,
        cache=False,
    )
    found = []
    for instance in built:
        if instance > high:
            break
        if instance >= low:
            found.append(instance)
    return found


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules(), st.integers(-400, 800), st.integers(1, 60))
def test_the_engine_agrees_with_dateutil(
    case: tuple[Rule, datetime], offset_days: int, length_days: int
) -> None:
    rule, start = case
    low = start + timedelta(days=offset_days)
    high = low + timedelta(days=length_days)
    expected = dateutil_instances(rule, start, low, high)
    mine = expand_rule(rule, start, low, high)
    if rule.count is not None:
        # RFC 5545 counts DTSTART even when the rule does not match it; dateutil does not
        first = next(iter(dateutil_instances(rule, start, start, start)), None)
        assume(first == start)
    if rule.by_set_position and rule.frequency == "WEEKLY":
        # a DTSTART the rule does not match gives an undefined set (RFC 5545 §3.8.5.3);
        # dateutil then starts the first week at DTSTART, cutting its BYSETPOS set short
        first = next(iter(dateutil_instances(rule, start, start, start)), None)
        assume(first == start)
    assert mine == [instance for instance in expected if instance != start]


def test_read_rule_reads_every_part() -> None:
    def until(text: str) -> datetime:
        return datetime(2026, 12, 31)

    rule = read_rule(
        "FREQ=MONTHLY;INTERVAL=2;UNTIL=20261231T000000Z;BYMONTH=1,7;BYMONTHDAY=1,-1;"
        "BYHOUR=9;BYMINUTE=30;BYSECOND=15;BYSETPOS=1;WKST=SU;X-VENDOR=1",
        until,
        all_day=False,
    )
    assert rule == Rule(
        frequency="MONTHLY", interval=2, until=datetime(2026, 12, 31), by_month=(1, 7),
        by_month_day=(1, -1), by_hour=(9,), by_minute=(30,), by_second=(15,),
        by_set_position=(1,), week_start=6,
    )  # fmt: skip


# --- objects passed over without reading ---------------------------------------------------

SINGLE = (
    "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nUID:far-away\r\n"
    "DTSTART;TZID=Europe/Paris:{start}\r\nDTEND;TZID=Europe/Paris:{end}\r\n{extra}"
    "END:VEVENT\r\nEND:VCALENDAR\r\n"
)


@pytest.mark.parametrize(
    ("start", "end", "extra", "skipped"),
    [
        ("20250101T090000", "20250101T100000", "", True),  # long before
        ("20270101T090000", "20270101T100000", "", True),  # long after
        ("20250101T090000", "20260310T100000", "", False),  # ends inside
        ("20260227T230000", "20260228T230000", "", False),  # within the two days' margin
        ("20250101T090000", "20250101T100000", "RRULE:FREQ=YEARLY\r\n", False),
        ("20250101T090000", "20250101T100000", "RECURRENCE-ID:20250101T080000Z\r\n", False),
        ("2025010", "1T090000", "", False),  # not plain dates
    ],
)
def test_outside_window_only_passes_over_what_surely_is(
    start: str, end: str, extra: str, skipped: bool
) -> None:
    from gpuresa.ical.window import outside_window

    text = SINGLE.format(start=start, end=end, extra=extra)
    assert outside_window(text, *WINDOW) == ("far-away" if skipped else None)
    assert outside_window(text.encode(), *WINDOW) == ("far-away" if skipped else None)


def test_outside_window_reads_folded_and_doubled_lines_properly() -> None:
    from gpuresa.ical.window import outside_window

    folded = SINGLE.format(start="2025\r\n 0101T090000", end="20250101T100000", extra="")
    assert outside_window(folded, *WINDOW) is None
    two = SINGLE.format(start="20250101T090000", end="20250101T100000", extra="").replace(
        "END:VCALENDAR", "BEGIN:VEVENT\r\nUID:b\r\nEND:VEVENT\r\nEND:VCALENDAR"
    )
    assert outside_window(two, *WINDOW) is None
