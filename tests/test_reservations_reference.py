"""The reader against the reference expander on the icalendar project's own test calendars.

Every calendar of tests/corpus/icalendar-project goes through gpuresa's reader
(`parse_object` + `expand`) and through icalendar + recurring-ical-events,
over a window from two days before the first DTSTART of its events to two
years after the last, and the occurrence instants (UTC start and end) must be
the same. A file agrees when both sides read all of it and find the same
instants. Every other file is in `DISAGREEMENTS`, with the side that does not
read it, what that side says, and why; a listed file that starts agreeing, or
whose disagreement changes, fails, so the list cannot outlive its reasons.
(No file is there because the reference gets it wrong: where both read a file,
they agree.)
"""

from __future__ import annotations

import re
import warnings
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Literal, NamedTuple
from zoneinfo import ZoneInfo

import icalendar
import pytest
import recurring_ical_events

from gpuresa.ical.events import expand
from gpuresa.ical.text import parse_object

CORPUS = Path(__file__).parent / "corpus" / "icalendar-project"
FILES = sorted(path.relative_to(CORPUS).as_posix() for path in CORPUS.rglob("*.ics"))
# where floating times and all-day events are (both sides get the same)
SITE = ZoneInfo("Europe/Paris")
DEFAULT_WINDOW = (datetime(2000, 1, 1, tzinfo=UTC), datetime(2030, 1, 1, tzinfo=UTC))

Instants = list[tuple[datetime, datetime]]


class Disagreement(NamedTuple):
    """Why a file is not expected to agree, and what shows it.

    `side` is the side that does not read the file: "reader" (gpuresa refuses
    some of it, by design), "reference" (icalendar or recurring-ical-events
    raises) or "both"; `says` is a fragment of the reader's problem (of the
    reference's error when only the reference fails).
    """

    side: Literal["reader", "reference", "both"]
    says: str
    reason: str


def reader(says: str, reason: str) -> Disagreement:
    return Disagreement("reader", says, reason)


def reference(says: str, reason: str) -> Disagreement:
    return Disagreement("reference", says, reason)


def both(says: str, reason: str) -> Disagreement:
    return Disagreement("both", says, reason)


# refused by design: nothing a booking could be read from
NOT_A_CALENDAR = "a bare component, not a VCALENDAR (RFC 5545 §3.4): refused by design"
NOT_ICALENDAR = "not iCalendar text (a fuzzer's mangled BEGIN line): refused by design"
CUT_SHORT = "the text ends before END:VCALENDAR (RFC 5545 §3.4): refused, events may be missing"
BROKEN_STRUCTURE = "END:VCALENDARD closes nothing (RFC 5545 §3.4): refused, the structure is broken"
BROKEN_LINE = (
    "'SUMMARY=testevent' is no property line (RFC 5545 §3.1): it spoils its event, "
    "as it may be the line that says who booked"
)
PERIOD_OF_DATES = (
    "an RDATE PERIOD of two dates (RFC 5545 §3.3.9 bounds a period by date-times): "
    "refused; the reference guesses midnight"
)
UNDEFINED_TZID = (
    "TZID CUSTOM_tzid names no zone and no VTIMEZONE defines it (RFC 5545 §3.2.19 wants "
    "one): refused; the reference guesses floating time"
)
# neither side reads it
NO_START = "an event without DTSTART (RFC 5545 §3.6.1): nothing to book; the reference raises"
TWO_STARTS = "an event with two DTSTARTs (RFC 5545 §3.6.1 allows one): which is meant is a guess"
BAD_VALUE = "a DTSTART, DURATION or FREQ that is no value of its type (RFC 5545 §3.3)"
RDATE_TIME = "RDATE;VALUE=TIME (RFC 5545 §3.8.5.2 allows DATE-TIME, DATE and PERIOD only)"
RSCALE = "RSCALE (RFC 7529), a non-Gregorian recurrence: refused by design"
# only the reference fails: the reader reads all of it
REFERENCE_EMPTY_PARAMETER = (
    "the reference cannot parse 'DTSTART;;VALUE=DATE-TIME' (an empty parameter)"
)
REFERENCE_STRAY_LINE = "the reference cannot parse the stray line 'X' between components"
REFERENCE_SPACED_RULE = (
    "the reference cannot parse the RRULE 'BYDAY=MO, TU, ...' (spaces in a list)"
)
REFERENCE_EMPTY_EXDATE = "the reference cannot parse an empty EXDATE"
REFERENCE_UNUSED_ZONE = "the reference cannot parse a VTIMEZONE offset of +5744 that no event uses"

DISAGREEMENTS: dict[str, Disagreement] = {
    "fuzzing/corpus/Index_Error.ics": both("not iCalendar text", NOT_ICALENDAR),
    "fuzzing/corpus/Type_Error.ics": both("not iCalendar text", NOT_ICALENDAR),
    "fuzzing/corpus/america_new_york.ics": both("more than one DTSTART", TWO_STARTS),
    "fuzzing/corpus/event_with_escaped_character1.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_escaped_character2.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_escaped_character3.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_escaped_character4.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_escaped_characters.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_recurrence.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "fuzzing/corpus/event_with_recurrence_exdates_on_different_lines.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_rsvp.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "fuzzing/corpus/event_with_unicode_fields.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/event_with_unicode_organizer.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_100_transformed_doctests_into_unittests.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_101_icalendar_chokes_on_umlauts_in_organizer.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_104_mark_events_broken.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_112_missing_tzinfo_on_exdate.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_156_RDATE_with_PERIOD.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_156_RDATE_with_PERIOD_list.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_157_removes_trailing_semicolon.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_184_broken_representation_of_period.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_464_invalid_rdate.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "fuzzing/corpus/issue_53_description_parsed_properly.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_64_event_with_ascii_summary.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_64_event_with_non_ascii_summary.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_70_rrule_causes_attribute_error.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "fuzzing/corpus/issue_82_expected_output.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "fuzzing/corpus/pacific_fiji.ics": both("more than one DTSTART", TWO_STARTS),
    "fuzzing/corpus/timezone_rdate.ics": reader("is not a 'NAME:value' property", BROKEN_LINE),
    "fuzzing/corpus/timezone_same_start_and_offset.ics": reader("END:VCALENDARD", BROKEN_STRUCTURE),
    "tests/alarms/example.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/alarms/rfc_5545_absolute_alarm_example.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/alarms/rfc_5545_end.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/alarms/start_date.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/availabilities/rfc_7953_1.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/availabilities/rfc_7953_2.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/calendars/america_new_york_forward_reference.ics": both(
        "more than one DTSTART", TWO_STARTS
    ),
    "tests/calendars/big_bad_calendar.ics": reader("ends inside VCALENDAR", CUT_SHORT),
    "tests/calendars/broken_dtstart.ics": both("DTSTART 'INVALID-DATE' is not ", BAD_VALUE),
    "tests/calendars/broken_ical.ics": reference("KeyError: 'DTSTART'", REFERENCE_EMPTY_PARAMETER),
    "tests/calendars/created_calendar_with_unicode_fields.ics": both("has no DTSTART", NO_START),
    "tests/calendars/fuzz_testcase_0_char_in_component_name.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/calendars/fuzz_testcase_invalid_month.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/calendars/fuzz_testcase_vtimezone_lone_cr.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/calendars/invalid_duration.ics": both("DURATION 'P999999999999999999W", BAD_VALUE),
    "tests/calendars/issue_104_broken_calendar.ics": reference(
        "Content line could not be parsed", REFERENCE_STRAY_LINE
    ),
    "tests/calendars/issue_1050_multiple_calendars.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_1050_uid_in_description.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_1081_invalid_rrule_freq.ics": both(
        "RRULE FREQ=INVALID_TYPE_CAUSES", BAD_VALUE
    ),
    "tests/calendars/issue_1081_invalid_start_and_end.ics": both(
        "DTSTART 'INVALID-DATE' is not ", BAD_VALUE
    ),
    "tests/calendars/issue_1081_invalid_start_valid_end.ics": both(
        "DTSTART 'INVALID-DATE' is not ", BAD_VALUE
    ),
    "tests/calendars/issue_1081_with_summary.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_1549_binary_attachment.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_1561_image_value.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_1633_rdate_with_dates.ics": reader(
        "must start at a time", PERIOD_OF_DATES
    ),
    "tests/calendars/issue_1633_rdate_with_dates_and_tzid.ics": reader(
        "must start at a time", PERIOD_OF_DATES
    ),
    "tests/calendars/issue_165_missing_event.ics": reference(
        "UNTIL parameter has a bad format", REFERENCE_SPACED_RULE
    ),
    "tests/calendars/issue_178_component_with_invalid_name_represented.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/calendars/issue_178_custom_component_contains_other.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/calendars/issue_322_expected_calendar.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_722_missing_VTIMEZONE_custom.ics": reader(
        "unknown time zone 'CUSTOM_tzid'", UNDEFINED_TZID
    ),
    "tests/calendars/issue_722_missing_timezones.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_798_related_to.ics": both("has no DTSTART", NO_START),
    "tests/calendars/issue_82_expected_output.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/calendars/multiple_timezones.ics": both("RDATE '083000'", RDATE_TIME),
    "tests/calendars/pacific_fiji.ics": both("more than one DTSTART", TWO_STARTS),
    "tests/calendars/parsing_error.ics": reference(
        "broken property 'EXDATE'", REFERENCE_EMPTY_EXDATE
    ),
    "tests/calendars/parsing_error_in_UTC_offset.ics": reference(
        "Offset must be less than 24 hours", REFERENCE_UNUSED_ZONE
    ),
    "tests/calendars/pr_480_summary_with_colon.ics": reader("ends inside VCALENDAR", CUT_SHORT),
    "tests/calendars/rfc_5545_RDATE_example.ics": both("has no DTSTART", NO_START),
    "tests/calendars/rfc_6868.ics": both("has no DTSTART", NO_START),
    "tests/calendars/rfc_7256_multi_value_parameters.ics": both("has no DTSTART", NO_START),
    "tests/calendars/rfc_7529.ics": both("RSCALE", RSCALE),
    "tests/calendars/rfc_7986_conferences.ics": both("has no DTSTART", NO_START),
    "tests/calendars/rfc_7986_image.ics": both("has no DTSTART", NO_START),
    "tests/calendars/rfc_9253_gap.ics": both("has no DTSTART", NO_START),
    "tests/calendars/rfc_9253_related_to.ics": both("has no DTSTART", NO_START),
    "tests/calendars/small_bad_calendar.ics": reader("ends inside VCALENDAR", CUT_SHORT),
    "tests/calendars/timezone_rdate.ics": reader("is not a 'NAME:value' property", BROKEN_LINE),
    "tests/calendars/timezone_same_start_and_offset.ics": reader(
        "END:VCALENDARD", BROKEN_STRUCTURE
    ),
    "tests/events/event_with_escaped_character1.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_escaped_character2.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_escaped_character3.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_escaped_character4.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_escaped_characters.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_recurrence.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/event_with_recurrence_exdates_on_different_lines.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_rsvp.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/event_with_unicode_fields.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/event_with_unicode_organizer.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_100_transformed_doctests_into_unittests.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_101_icalendar_chokes_on_umlauts_in_organizer.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_104_mark_events_broken.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_112_missing_tzinfo_on_exdate.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_156_RDATE_with_PERIOD.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_156_RDATE_with_PERIOD_list.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_157_removes_trailing_semicolon.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_184_broken_representation_of_period.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_355_url_escaping.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/issue_355_url_escaping_2.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/issue_355_url_escaping_empty_param.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_464_invalid_rdate.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/issue_53_description_parsed_properly.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_64_event_with_ascii_summary.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_64_event_with_non_ascii_summary.ics": both(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_70_rrule_causes_attribute_error.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/events/issue_82_expected_output.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_7265_example_4.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_7265_request_status.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_9074_example_1.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_9074_example_2.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_9074_example_3.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_9074_example_4.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/events/rfc_9074_example_proximity.ics": both("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/freebusy/example.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/journals/example.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/timezones/issue_237_brazilia_standard.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/timezones/issue_53_tzid_parsed_properly.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/timezones/issue_55_parse_error_on_utc_offset_with_seconds.ics": reader(
        "expected BEGIN:VCALENDAR", NOT_A_CALENDAR
    ),
    "tests/timezones/pacific_fiji.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
    "tests/todos/example.ics": reader("expected BEGIN:VCALENDAR", NOT_A_CALENDAR),
}


# --- the two sides ------------------------------------------------------------------------

_EVENT = re.compile(r"BEGIN:VEVENT(.*?)END:VEVENT", re.DOTALL)
_START_DAY = re.compile(r"^DTSTART[;:][^\n]*?(\d{8})", re.MULTILINE)


def window_of(data: bytes) -> tuple[datetime, datetime]:
    """From two days before the first DTSTART of the file's events to two years after the last."""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\n ", "")
    days: list[datetime] = []
    for block in _EVENT.findall(text):
        for digits in _START_DAY.findall(block):
            try:
                days.append(datetime.strptime(digits, "%Y%m%d").replace(tzinfo=UTC))
            except ValueError:
                continue  # a broken date: that side says so
    if not days:
        return DEFAULT_WINDOW
    return min(days) - timedelta(days=2), max(days) + timedelta(days=731)


def _as_utc(value: date | datetime) -> datetime:
    if not isinstance(value, datetime):
        return datetime.combine(value, time(), SITE).astimezone(UTC)
    if value.tzinfo is None:
        return value.replace(tzinfo=SITE).astimezone(UTC)
    return value.astimezone(UTC)


def reference_instants(data: bytes, start: datetime, end: datetime) -> Instants | str:
    """The instants icalendar + recurring-ical-events find, or what they raised."""
    found: Instants = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for calendar in icalendar.Calendar.from_ical(data, multiple=True):
                # the window on the site's clock: the reference reads dates and floating
                # times on the clock of the window it is given, the reader on the site's
                query = recurring_ical_events.of(calendar)
                for event in query.between(start.astimezone(SITE), end.astimezone(SITE)):
                    if str(event.get("STATUS", "")).upper() == "CANCELLED":
                        continue
                    event_start = event.decoded("DTSTART")
                    if "DTEND" in event:
                        event_end = _as_utc(event.decoded("DTEND"))
                    elif "DURATION" in event:
                        event_end = _as_utc(event_start) + event.decoded("DURATION")
                    elif isinstance(event_start, datetime):
                        event_end = _as_utc(event_start)
                    else:
                        event_end = _as_utc(event_start + timedelta(days=1))
                    found.append((_as_utc(event_start), event_end))
    except Exception as error:  # the reference raises many kinds on a broken calendar
        return f"{type(error).__name__}: {error}"
    return sorted(found)


def reader_instants(data: bytes, start: datetime, end: datetime) -> tuple[Instants, list[str]]:
    """The instants gpuresa's reader finds, and the problems it reports."""
    occurrences, problems = expand([("file.ics", parse_object(data))], start, end, SITE)
    return sorted((item.start, item.end) for item in occurrences), [
        problem.reason for problem in problems
    ]


# --- the comparison -----------------------------------------------------------------------


def test_the_corpus_is_there_and_every_listed_file_is_in_it() -> None:
    assert len(FILES) > 150
    assert set(DISAGREEMENTS) <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_the_reader_agrees_with_the_reference(name: str) -> None:
    data = (CORPUS / name).read_bytes()
    start, end = window_of(data)
    mine, problems = reader_instants(data, start, end)
    theirs = reference_instants(data, start, end)
    listed = DISAGREEMENTS.get(name)
    if listed is None:
        assert problems == [], "the reader refuses what the reference reads"
        assert isinstance(theirs, list), f"the reference fails: {theirs}"
        assert mine == theirs
        return
    reader_refuses = bool(problems)
    reference_fails = isinstance(theirs, str)
    agrees = not (reader_refuses or reference_fails) and mine == theirs
    assert not agrees, f"{name} agrees now: take it off the list"
    if listed.side == "reader":
        assert reader_refuses and not reference_fails, (problems, theirs)
    elif listed.side == "reference":
        assert reference_fails and not reader_refuses, (problems, theirs)
    else:
        assert reader_refuses and reference_fails, (problems, theirs)
    said = str(theirs) if listed.side == "reference" else " / ".join(problems)
    assert listed.says in said
