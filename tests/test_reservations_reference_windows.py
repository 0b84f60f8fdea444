"""The reader against the reference expander on both projects' calendars, in daemon windows.

Beside the long windows of tests/test_reservations_reference.py, every calendar
of tests/corpus/icalendar-project and tests/corpus/recurring-ical-events
(the recurring-ical-events project's own test calendars) is compared in the
windows the daemon reads: from `window_past` before to `window_ahead` after
"now", with "now" at noon (UTC) of each day a VEVENT of the file starts on or
overrides (at most `MAX_NOWS` of them, spread over the file), and in the long
window. A file agrees when both sides read all of it and find the same
instants in every window. Every other file of the recurring-ical-events
corpus is in `DISAGREEMENTS` with its reason, checked both ways: a listed file
that starts agreeing, or whose disagreement changes, fails. `test_agreement`
holds the share of agreeing files among those both sides read at 95 % or more.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_reservations_reference import (
    DISAGREEMENTS as ICALENDAR_DISAGREEMENTS,
)
from test_reservations_reference import (
    Disagreement,
    Instants,
    both,
    reader,
    reader_instants,
    reference_instants,
    window_of,
)

from gpuresa.config.calendar_sections import ReservationsConfig

CORPORA = Path(__file__).parent / "corpus"
ICALENDAR = "icalendar-project"
PROJECT = "recurring-ical-events"
FILES = sorted(
    f"{corpus}/{path.relative_to(CORPORA / corpus).as_posix()}"
    for corpus in (ICALENDAR, PROJECT)
    for path in (CORPORA / corpus).rglob("*.ics")
)
DAEMON = ReservationsConfig()
MAX_NOWS = 12

NO_FREQ = (
    "an RRULE without FREQ (RFC 5545 §3.3.10: FREQ is required; a published holiday "
    "calendar): refused, the reference guesses a frequency"
)
NEGATIVE_COUNT = "COUNT=-1 (RFC 5545 §3.3.10 wants a positive integer): refused, a guess"
END_BEFORE_START = (
    "DTEND before DTSTART (RFC 5545 §3.6.1 wants it later): refused; the reference swaps "
    "them, a guess at what was booked"
)
UNTIL_BEFORE_START = (
    "UNTIL before DTSTART: RFC 5545 counts DTSTART as one instance, the reference finds "
    "none; refused, which was meant is a guess"
)
BROKEN_STRUCTURE = "END:VTOOD closes nothing (RFC 5545 §3.4): refused, the structure is broken"
TWO_MASTERS = (
    "two series of one UID, one with an EXDATE (RFC 5545 §3.8.4.7: a UID names one "
    "series): the reader takes one, the reference merges them"
)
DELETED_MOVED = (
    "a moved occurrence then cancelled by a later revision: the reader keeps the moved "
    "override, the reference drops it"
)
STRAY_OVERRIDE = (
    "a RECURRENCE-ID that names no instance of the rule: the reader books the override, "
    "the reference drops it"
)
DATE_TIME_OVERRIDE = (
    "a date-time RECURRENCE-ID on a series of dates (RFC 5545 §3.8.4.4 wants a date): "
    "the reader does not match it to the day, the reference does"
)
THIS_AND_FUTURE = (
    "RANGE=THISANDFUTURE moving a later part of the series: the reader and the reference "
    "shift the later instances differently"
)
SEVERAL_RULES = (
    "two RRULEs (deprecated by RFC 5545): both sides take the union, but differ on an "
    "instance near a DST change"
)
MISSPELLED_PART = "RRULE part UNTL (for UNTIL): both refuse; read as no end, it books forever"

DISAGREEMENTS: dict[str, Disagreement] = {
    f"{PROJECT}/calendars/Germany_Holidays.ics": reader("RRULE has no FREQ", NO_FREQ),
    f"{PROJECT}/calendars/end_before_start_event.ics": reader(
        "it ends before it starts", END_BEFORE_START
    ),
    f"{PROJECT}/calendars/issue_132_swapped_start_and_end.ics": reader(
        "it ends before it starts", END_BEFORE_START
    ),
    f"{PROJECT}/calendars/issue_117_until_before_dtstart.ics": reader(
        "RRULE UNTIL '20231001' is before DTSTART", UNTIL_BEFORE_START
    ),
    f"{PROJECT}/calendars/issue_128_only_first_event.ics": reader("COUNT=-1", NEGATIVE_COUNT),
    f"{PROJECT}/calendars/issue_201_test_matrix.ics": reader("END:VTOOD", BROKEN_STRUCTURE),
    f"{PROJECT}/calendars/bad_rrule_missing_until_event.ics": both(
        "RRULE part UNTL is not known", MISSPELLED_PART
    ),
}
# the reader and the reference both read these, and find different instants
DIFFERENT: dict[str, str] = {
    f"{PROJECT}/calendars/issue_148_edge_case_1.ics": TWO_MASTERS,
    f"{PROJECT}/calendars/issue_163_deleted_modification.ics": DELETED_MOVED,
    f"{PROJECT}/calendars/issue_253_additional_recurrence_id.ics": STRAY_OVERRIDE,
    f"{PROJECT}/calendars/issue_28_rrule_with_UTC_endinginZ.ics": DATE_TIME_OVERRIDE,
    f"{PROJECT}/calendars/issue_36_recurrence_ID_format.ics": DATE_TIME_OVERRIDE,
    f"{PROJECT}/calendars/issue_75_range_parameter.ics": THIS_AND_FUTURE,
    f"{PROJECT}/calendars/multiple_rrule.ics": SEVERAL_RULES,
}

_DAYS = re.compile(r"^(?:DTSTART|RECURRENCE-ID)[;:][^\n]*?(\d{8})", re.MULTILINE)


def windows_of(data: bytes) -> list[tuple[datetime, datetime]]:
    """The long window, then the daemon's windows around noon of the file's start days."""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\n ", "")
    days: set[datetime] = set()
    for digits in _DAYS.findall(text):
        try:
            days.add(datetime.strptime(digits, "%Y%m%d").replace(hour=12, tzinfo=UTC))
        except ValueError:
            continue
    ordered = sorted(days)
    step = max(1, len(ordered) // MAX_NOWS + (len(ordered) % MAX_NOWS > 0))
    nows = ordered[::step]
    daemon = [(now - DAEMON.window_past, now + DAEMON.window_ahead) for now in nows]
    return [window_of(data), *daemon]


def compare(name: str) -> tuple[bool, bool, list[str], str | None, list[Instants]]:
    """(reader refuses, reference fails, reader's problems, reference's error, mismatches)."""
    data = (CORPORA / name).read_bytes()
    problems: list[str] = []
    error: str | None = None
    mismatches: list[Instants] = []
    for start, end in windows_of(data):
        mine, found = reader_instants(data, start, end)
        theirs = reference_instants(data, start, end)
        problems = problems or found
        if isinstance(theirs, str):
            error = error or theirs
        elif not found and mine != theirs:
            mismatches.append(sorted(set(mine) ^ set(theirs)))
    return bool(problems), error is not None, problems, error, mismatches


def listed(name: str) -> Disagreement | None:
    if name.startswith(f"{ICALENDAR}/"):
        return ICALENDAR_DISAGREEMENTS.get(name.removeprefix(f"{ICALENDAR}/"))
    return DISAGREEMENTS.get(name)


def test_every_listed_file_is_in_the_corpus() -> None:
    assert len([name for name in FILES if name.startswith(PROJECT)]) > 80
    assert (CORPORA / PROJECT / "LICENSE").is_file()
    assert set(DISAGREEMENTS) | set(DIFFERENT) <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_the_reader_agrees_in_the_daemons_windows(name: str) -> None:
    refuses, fails, problems, error, mismatches = compare(name)
    entry = listed(name)
    if name in DIFFERENT:
        assert not refuses and not fails, (problems, error)
        assert mismatches, f"{name} agrees now: take it off the list"
        return
    if entry is None:
        assert not refuses, f"the reader refuses what the reference reads: {problems}"
        assert not fails, f"the reference fails: {error}"
        assert mismatches == []
        return
    assert refuses or fails, f"{name} is read by both now: take it off the list"
    expected = {"reader": (True, False), "reference": (False, True), "both": (True, True)}
    assert (refuses, fails) == expected[entry.side], (problems, error)
    said = str(error) if entry.side == "reference" else " / ".join(problems)
    assert entry.says in said


def test_agreement() -> None:
    """At least 95 % of the files both sides read agree in every window, in both corpora.

    Counted from the lists: the test above holds every file to its entry (a listed file
    disagrees as listed, an unlisted one agrees), so the lists are what the sides do.
    """
    both_read = [name for name in FILES if listed(name) is None]
    agreeing = [name for name in both_read if name not in DIFFERENT]
    assert len(both_read) > 150
    assert len(agreeing) / len(both_read) >= 0.95, f"{len(agreeing)} of {len(both_read)}"
