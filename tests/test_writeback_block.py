"""gpuresa's block in a booking's event: the raw edit keeps every other byte; readers skip it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import icalendar
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuresa.ical.state_block import (
    BLOCK_START,
    DETAIL_PROPERTY,
    OWN_PROPERTIES,
    STATE_PROPERTY,
    escape_text,
    fold,
    strip_block,
    without_own_part,
    write_block,
)
from gpuresa.journal.writeback import WriteBackRow
from gpuresa.reservations.booking_fields import description_fields
from gpuresa.writeback import wording
from gpuresa.writeback.mirror import mirror_event, mirror_uid


def event(description: str | None, newline: str = "\r\n", extra: str = "") -> str:
    lines = [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:-//test//EN",
        "BEGIN:VEVENT",
        "UID:booking-1",
        "DTSTAMP:20260101T080000Z",
        "DTSTART:20260102T100000Z",
        "DTEND:20260102T120000Z",
        "SUMMARY:alice",
        "ORGANIZER:mailto:alice@example.org",
    ]
    if description is not None:
        lines += [
            part.rstrip("\r\n") for part in fold("DESCRIPTION:" + escape_text(description), "\n")
        ]
    lines += [*filter(None, extra.split("\n")), "END:VEVENT", "END:VCALENDAR"]
    return newline.join(lines) + newline


def not_ours(text: str) -> list[str]:
    """The physical lines of `text` that are neither DESCRIPTION (and its folds) nor
    gpuresa's properties."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line[:1] in " \t":
            if not skipping:
                kept.append(line)
            continue
        name = line.split(":", 1)[0].split(";", 1)[0].upper()
        skipping = name == "DESCRIPTION" or name in OWN_PROPERTIES
        if not skipping:
            kept.append(line)
    return kept


def description_of(text: str) -> str:
    component = icalendar.Calendar.from_ical(text).walk("VEVENT")[0]
    return str(component.get("DESCRIPTION", ""))


user_text = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\u2028\u2029\x85")
    | st.sampled_from(["\n", ";", ",", "\\", "é", "—"]),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(user_text, st.text(min_size=1, max_size=300).filter(lambda text: text.strip()))
def test_the_block_leaves_every_other_byte_and_the_users_text_as_they_were(
    description: str, block: str
) -> None:
    block = block.replace("\r", "")
    original = event(description or None)
    written = write_block(original, "booking-1", "running", "ssh -p 2201 alice@gpu1", block)
    assert written is not None
    assert not_ours(written) == not_ours(original)
    assert strip_block(description_of(written)) == (description or "")
    assert without_own_part(written) == without_own_part(original)
    # a second state replaces the block: one block, never two
    again = write_block(written, "booking-1", "ended", "output kept", "Ended.")
    assert again is not None and again.count(BLOCK_START) == 1
    assert strip_block(description_of(again)) == (description or "")
    # the same state again is no change at all
    assert write_block(again, "booking-1", "ended", "output kept", "Ended.") == again
    for line in again.splitlines():
        assert len(line.encode()) <= 75 or line in original.splitlines()


def test_the_users_folded_lines_stay_byte_for_byte_and_line_endings_are_kept() -> None:
    original = event("template: pytorch\n" + "a long line of the user's own words " * 5, "\n")
    written = write_block(original, "booking-1", "prepared", "prepared", "Prepared on gpu1.")
    assert written is not None and "\r\n" not in written
    others = not_ours(original)
    old_description = [line for line in original.splitlines(keepends=True) if line not in others]
    new_lines = written.splitlines(keepends=True)
    # every physical line of the old DESCRIPTION is still there, in order, untouched
    start = new_lines.index(old_description[0])
    assert [line.rstrip("\n") for line in new_lines[start : start + len(old_description)]] == [
        line.rstrip("\n") for line in old_description
    ]


def test_only_the_events_own_description_is_touched_not_its_alarms_nor_an_override() -> None:
    alarm = "BEGIN:VALARM\nACTION:DISPLAY\nDESCRIPTION:reminder\nTRIGGER:-PT15M\nEND:VALARM"
    master = event("mine", extra="RRULE:FREQ=DAILY;COUNT=3\n" + alarm)
    override = (
        "BEGIN:VEVENT\r\nUID:booking-1\r\nRECURRENCE-ID:20260103T100000Z\r\n"
        "DTSTART:20260103T110000Z\r\nDTEND:20260103T130000Z\r\nDESCRIPTION:moved\r\nEND:VEVENT\r\n"
    )
    # the override first: the master is still the one written on
    text = master.replace("BEGIN:VEVENT", override + "BEGIN:VEVENT", 1)
    written = write_block(text, "booking-1", "running", "detail", "Running.")
    assert written is not None
    assert "DESCRIPTION:moved\r\n" in written and "DESCRIPTION:reminder\r\n" in written
    components = icalendar.Calendar.from_ical(written).walk("VEVENT")
    master_event = next(item for item in components if "RECURRENCE-ID" not in item)
    assert str(master_event[STATE_PROPERTY]) == "running"
    # gpuresa's properties come before the alarm (RFC 5545: properties, then components)
    assert written.index(STATE_PROPERTY) < written.index("BEGIN:VALARM")
    assert write_block(written, "other-uid", "running", "d", "t") is None


def test_an_event_without_description_gets_one_and_stripping_it_gives_nothing_back() -> None:
    original = event(None)
    written = write_block(original, "booking-1", "refused", "no such template", "Refused: x")
    assert written is not None
    assert description_of(written).startswith(BLOCK_START)
    assert without_own_part(written) == without_own_part(original)
    assert f"{DETAIL_PROPERTY}:no such template" in written


def test_a_block_that_looks_like_booking_fields_is_never_read_as_one() -> None:
    """Hostile: a state text holding `gpus: 8` (a reason quoting the booking) changes nothing."""
    original = event("template: pytorch\ngpus: 1")
    written = write_block(
        original, "booking-1", "refused", "x", "Refused: gpus: 8\ntemplate: evil\ncuda: 1.0"
    )
    assert written is not None
    fields = description_fields(description_of(written))
    assert fields == {"template": "pytorch", "gpus": "1"}
    # and with no field of the user's, none at all
    bare = write_block(event(None), "booking-1", "refused", "x", "gpus: 8\npreemptible: yes")
    assert bare is not None and description_fields(description_of(bare)) == {}


def test_text_the_user_typed_after_an_old_block_is_kept() -> None:
    written = write_block(event("before"), "booking-1", "running", "d", "Running.")
    assert written is not None
    edited = written.replace("end gpuresa ——", "end gpuresa ——\\nafter", 1)
    again = write_block(edited, "booking-1", "ended", "d", "Ended.")
    assert again is not None
    assert strip_block(description_of(again)) == "before\nafter"


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (wording.refused("unknown template 'tf9'", None, "UTC"), ["Refused", "tf9"]),
        (
            wording.prepared("gpu1", datetime(2026, 1, 2, 10, tzinfo=UTC), "Europe/Paris"),
            ["Prepared on gpu1", "11:00 CET"],
        ),
        (
            wording.running(
                host="gpu1.example.org",
                ssh_line="ssh -p 2201 alice@gpu1.example.org",
                trust_lines="@cert-authority [gpu1.example.org]:2201 ssh-ed25519 AAAA",
                end=datetime(2026, 1, 2, 12, tzinfo=UTC),
                output_target=Path("/output"),
                outputs_command="sftp -P 222 alice@gpu1.example.org",
                timezone="UTC",
            ),
            ["ssh -p 2201 alice@gpu1.example.org", "@cert-authority", "/output", "sftp -P 222"],
        ),
        (
            wording.ended(
                host="gpu1",
                at=datetime(2026, 1, 2, 12, tzinfo=UTC),
                output_dir=Path("/srv/outputs/alice/booking-1"),
                outputs_command="sftp -P 222 alice@gpu1",
                removal=datetime(2026, 2, 1, 12, tzinfo=UTC),
                timezone="UTC",
                how="preempted",
            ),
            ["/srv/outputs/alice/booking-1", "2026-02-01", "preempted"],
        ),
    ],
)
def test_each_state_says_what_its_users_need(
    state: wording.CalendarState, expected: list[str]
) -> None:
    for text in expected:
        assert text in state.text
    assert "\n" not in state.detail


def test_a_mirror_event_is_the_bookings_times_and_state_and_the_same_bytes_each_time() -> None:
    at = datetime(2026, 1, 1, 8, tzinfo=UTC)
    row = WriteBackRow(
        key="booking-1@20260102T100000Z",
        calendar="gpu1",
        uid="booking-1",
        href="",
        state="running",
        detail="ssh -p 2201 alice@gpu1",
        text="Running on gpu1.\nssh -p 2201 alice@gpu1",
        summary="alice",
        start=datetime(2026, 1, 2, 10, tzinfo=UTC),
        end=datetime(2026, 1, 2, 12, tzinfo=UTC),
        queued_at=at,
        attempts=0,
        last_error=None,
        next_try=at,
        written_at=None,
    )
    text = mirror_event(row)
    assert text is not None and text == mirror_event(row)
    component = icalendar.Calendar.from_ical(text).walk("VEVENT")[0]
    assert str(component["UID"]) == mirror_uid(row.key) != mirror_uid("booking-1")
    assert component.decoded("DTSTART") == row.start
    assert str(component[STATE_PROPERTY]) == "running"
    assert "ssh -p 2201 alice@gpu1" in str(component["DESCRIPTION"])


@pytest.mark.parametrize(
    ("calendar", "problem"),
    [
        ({"kind": "ics", "url": "/srv/bookings", "write_back": "event"}, 'write_back: "event"'),
        ({"write_back": "mirror"}, 'mirror_url: write_back = "mirror" needs'),
        ({"mirror_url": "https://dav.example.org/m/"}, "mirror_url: only with"),
        (
            {"write_back": "mirror", "mirror_url": "https://dav.example.org/cal/"},
            "mirror_url: the mirror cannot be the calendar",
        ),
        ({"write_back": "mirror", "mirror_url": "ftp://x/"}, "mirror_url: expected an http(s)"),
        (
            {"kind": "ics", "url": "/srv/b", "write_back": "mirror", "mirror_url": "https://d/m/"},
            "mirror_username: the mirror's account",
        ),
        (
            {"write_back": "mirror", "mirror_url": "https://d/m/", "mirror_username": "x"},
            "mirror_username: needs mirror_password_file",
        ),
        ({"write_back": "both"}, "write_back"),
        ({"write_timeout": "0s"}, "write_timeout"),
    ],
)
def test_each_write_back_check_rejects_with_its_key_path(
    calendar: dict[str, str], problem: str
) -> None:
    from gpuresa.config.reading import parse_config
    from gpuresa.errors import UserError

    table = {"name": "gpu1", "url": "https://dav.example.org/cal/", **calendar}
    with pytest.raises(UserError) as caught:
        parse_config({"calendars": [table]}, "test.toml")
    assert f"calendars[gpu1].{problem}" in str(caught.value)
