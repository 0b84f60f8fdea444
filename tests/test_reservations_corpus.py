"""The fixture corpus: calendars written the way real apps write them.

Google, Outlook/Exchange, Nextcloud, Thunderbird and a LibreBooking feed. Each
file's reservations are spelled out by hand (times in UTC, computed from the
zones and DST dates), and every occurrence time is also checked against
icalendar + recurring-ical-events as an independent oracle.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import icalendar
import pytest
import recurring_ical_events

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.ical.events import expand
from gpuresa.ical.text import parse_object
from gpuresa.model import ReservationSet
from gpuresa.reservations.rules import read_reservations

CORPUS = Path(__file__).parent / "corpus"
PARIS = ZoneInfo("Europe/Paris")
HOSTS = [{"name": "gpu1", "gpus": [0, 1, 2, 3]}, {"name": "gpu2", "gpus": [0, 1, 2, 3]}]


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def config_for(calendar: Mapping[str, Any], **reservations: Any) -> Config:
    return parse_config(
        {
            "daemon": {"host": "gpu1"},
            "hosts": HOSTS,
            "reservations": {"timezone": "Europe/Paris", **reservations},
            "calendars": [{"name": "corpus", "url": "/corpus.ics", "kind": "ics", **calendar}],
        }
    )


def read(name: str, config: Config, start: str, end: str) -> ReservationSet:
    data = (CORPUS / name).read_bytes()
    return read_reservations(config, {"corpus": [(name, data)]}, utc(start), utc(end))


Row = tuple[str, str, str, str, str | None, int, str, str]


def rows(found: ReservationSet) -> list[Row]:
    return [
        (
            item.key,
            item.user,
            item.host,
            item.template,
            item.cuda,
            item.gpus,
            item.start.isoformat(),
            item.end.isoformat(),
        )
        for item in found.reservations
    ]


ALICE = "1q2w3e4r5t6y7u8i9o0p@google.com"
BOB = "0a9s8d7f6g5h4j3k2l1@google.com"


def test_google_export_dst_exdate_moved_occurrence_x_wr_timezone_and_all_day() -> None:
    found = read("google.ics", config_for({"host": "gpu1"}), "2026-03-15", "2026-04-30")
    assert rows(found) == [
        # Mondays 09:00 Paris: 08:00Z in winter time...
        (f"{ALICE}@20260316T080000Z", "alice", "gpu1", "pytorch", "12.4", 2,
         "2026-03-16T08:00:00+00:00", "2026-03-16T11:00:00+00:00"),
        (f"{ALICE}@20260323T080000Z", "alice", "gpu1", "pytorch", "12.4", 2,
         "2026-03-23T08:00:00+00:00", "2026-03-23T11:00:00+00:00"),
        # written in UTC, repeated in X-WR-TIMEZONE (18:00 Paris), HTML description
        (f"{BOB}@20260325T170000Z", "bob", "gpu1", "tensorflow", "12.2", 1,
         "2026-03-25T17:00:00+00:00", "2026-03-25T20:00:00+00:00"),
        # all-day over the DST weekend: 00:00 to 00:00 Paris is 47 hours; gpus: all
        ("zxcvbnmasdfghjkl@google.com", "carol", "gpu1", "digits", "11.4", 4,
         "2026-03-27T23:00:00+00:00", "2026-03-29T22:00:00+00:00"),
        # ...and 07:00Z in summer time (DST began on 2026-03-29)
        (f"{ALICE}@20260330T070000Z", "alice", "gpu1", "pytorch", "12.4", 2,
         "2026-03-30T07:00:00+00:00", "2026-03-30T10:00:00+00:00"),
        (f"{BOB}@20260401T160000Z", "bob", "gpu1", "tensorflow", "12.2", 1,
         "2026-04-01T16:00:00+00:00", "2026-04-01T19:00:00+00:00"),
        (f"{BOB}@20260408T160000Z", "bob", "gpu1", "tensorflow", "12.2", 1,
         "2026-04-08T16:00:00+00:00", "2026-04-08T19:00:00+00:00"),
        # EXDATE took out 2026-04-06; 2026-04-13 moved to Tuesday afternoon, same key
        (f"{ALICE}@20260413T070000Z", "alice", "gpu1", "pytorch", "12.4", 2,
         "2026-04-14T12:00:00+00:00", "2026-04-14T15:00:00+00:00"),
        (f"{ALICE}@20260420T070000Z", "alice", "gpu1", "pytorch", "12.4", 2,
         "2026-04-20T07:00:00+00:00", "2026-04-20T10:00:00+00:00"),
    ]  # fmt: skip
    # the cancelled event is no reservation, and nothing is rejected
    assert found.rejected == ()
    first = found.reservations[0]
    assert first.email == "alice.martin@example.org"
    assert first.created == utc("2026-03-01T10:10:10")
    assert first.recurrence_id == "20260316T080000Z"


OUTLOOK_DAILY = (
    "040000008200E00074C5B7101A82E00800000000B0A6C1D3A5A9DC01000000000000000"
    "0100000003F3C6B2E1D0A4B4C9E8F7A6B5C4D3E2F"
)


def test_outlook_export_windows_zones_custom_zone_and_new_york_dst() -> None:
    calendar = {
        "host": "gpu2",
        "user_from": "organizer",
        "email_logins": {"dave.martin@example.org": "dave"},
    }
    found = read("outlook.ics", config_for(calendar), "2026-03-01", "2026-11-30")
    # series by RECURRENCE-ID, single events by the end of their (long) UID
    got = {(key.split("@")[-1] if "@" in key else key[-8:]): rest for key, *rest in rows(found)}
    assert got == {
        # "Eastern Standard Time", 22:00 daily: EST is UTC-5 until 2026-03-08, then EDT
        "20260307T030000Z": ["dave", "gpu2", "pytorch", "11.8", 1,
                             "2026-03-07T03:00:00+00:00", "2026-03-07T04:30:00+00:00"],
        "20260308T030000Z": ["dave", "gpu2", "pytorch", "11.8", 1,
                             "2026-03-08T03:00:00+00:00", "2026-03-08T04:30:00+00:00"],
        "20260309T020000Z": ["dave", "gpu2", "pytorch", "11.8", 1,
                             "2026-03-09T02:00:00+00:00", "2026-03-09T03:30:00+00:00"],
        # UNTIL=20260310T020000Z takes in this last one exactly
        "20260310T020000Z": ["dave", "gpu2", "pytorch", "11.8", 1,
                             "2026-03-10T02:00:00+00:00", "2026-03-10T03:30:00+00:00"],
        # "Customized Time Zone": only its VTIMEZONE says it is UTC+1
        "DDCCBBAA": ["frank", "gpu2", "digits", "11.4", 1,
                                      "2026-03-20T09:00:00+00:00", "2026-03-20T10:00:00+00:00"],
        # "Romance Standard Time" (Paris) over the night DST ends: 22:00 CEST to 06:00 CET
        "CCDDEEFF": ["erin", "gpu2", "tensorflow", "12.3", 4,
                                      "2026-10-24T20:00:00+00:00", "2026-10-25T05:00:00+00:00"],
        # New York's DST ends inside this one: 23:00 EDT to 03:00 EST
        "55AA55AA": ["dave", "gpu2", "pytorch", "12.4", 2,
                     "2026-11-01T03:00:00+00:00", "2026-11-01T08:00:00+00:00"],
    }  # fmt: skip
    assert found.rejected == ()
    assert found.reservations[0].key == f"{OUTLOOK_DAILY}@20260307T030000Z"
    assert found.reservations[0].email == "dave.martin@example.org"


def test_nextcloud_monthly_series_with_alarm_and_x_gpuresa_properties() -> None:
    found = read("nextcloud.ics", config_for({"host": "gpu1"}), "2026-03-01", "2026-06-30")
    series = "5b1e0a4c-2f7d-4c1e-9a3b-7d6e5f4a3b2c"
    assert rows(found) == [
        (f"{series}@20260303T130000Z", "heidi", "gpu1", "tensorflow", "11.8", 3,
         "2026-03-03T13:00:00+00:00", "2026-03-03T17:00:00+00:00"),
        # X-GPURESA-* properties, DURATION instead of DTEND, gpus "all" on a 4-GPU host
        ("booked-by-script-7f3e", "ivan", "gpu1", "digits", "11.1", 4,
         "2026-03-12T08:00:00+00:00", "2026-03-12T14:00:00+00:00"),
        (f"{series}@20260407T120000Z", "heidi", "gpu1", "tensorflow", "11.8", 3,
         "2026-04-07T12:00:00+00:00", "2026-04-07T16:00:00+00:00"),
        (f"{series}@20260505T120000Z", "heidi", "gpu1", "tensorflow", "11.8", 3,
         "2026-05-05T12:00:00+00:00", "2026-05-05T16:00:00+00:00"),
        (f"{series}@20260602T120000Z", "heidi", "gpu1", "tensorflow", "11.8", 3,
         "2026-06-02T12:00:00+00:00", "2026-06-02T16:00:00+00:00"),
    ]  # fmt: skip
    assert found.rejected == ()


def test_thunderbird_cancelled_occurrence_floating_time_and_mozilla_tzid() -> None:
    found = read("thunderbird.ics", config_for({"host": "gpu1"}), "2026-03-16", "2026-04-05")
    series = "9f8e7d6c-5b4a-4321-8765-0fedcba98765"
    assert [(key, start, end) for key, *_, start, end in rows(found)] == [
        (f"{series}@20260317T090000Z", "2026-03-17T09:00:00+00:00", "2026-03-17T12:00:00+00:00"),
        (f"{series}@20260320T090000Z", "2026-03-20T09:00:00+00:00", "2026-03-20T12:00:00+00:00"),
        # 2026-03-24 was cancelled (an override with STATUS:CANCELLED)
        (f"{series}@20260327T090000Z", "2026-03-27T09:00:00+00:00", "2026-03-27T12:00:00+00:00"),
        (f"{series}@20260331T080000Z", "2026-03-31T08:00:00+00:00", "2026-03-31T11:00:00+00:00"),
        # floating 14:00: the site's zone (Paris, summer time)
        ("c0ffee00-1111-2222-3333-444455556666",
         "2026-03-31T12:00:00+00:00", "2026-03-31T14:00:00+00:00"),
        # TZID=/mozilla.org/20070129_1/Europe/Paris
        ("legacy-tzid-0001", "2026-04-01T07:00:00+00:00", "2026-04-01T08:00:00+00:00"),
        (f"{series}@20260403T080000Z", "2026-04-03T08:00:00+00:00", "2026-04-03T11:00:00+00:00"),
    ]  # fmt: skip
    assert {item.user for item in found.reservations} == {"judy", "mallory", "niaj"}
    assert found.rejected == ()


def test_librebooking_feed_hosts_from_location_tentative_and_over_booking() -> None:
    config = config_for({"user_from": "organizer"})
    found = read("librebooking.ics", config, "2026-03-16", "2026-03-31")
    kept = [
        (key.split("@")[0], user, host, gpus) for key, user, host, _, _, gpus, _, _ in rows(found)
    ]
    assert kept == [
        ("69a3f1c2b4d5e", "alice", "gpu1", 1),
        ("69a5aaaa00001", "peggy", "gpu2", 3),
        # Victor's starts when Peggy's ends; Trent's (rejected) does not count
        ("69a6cccc00003", "victor", "gpu2", 1),
        ("69a3f1c2b9e7a", "alice", "gpu1", 1),
    ]  # fmt: skip
    reasons = {item.key.split("@")[0]: item.reason for item in found.rejected}
    assert reasons.keys() == {"69a6bbbb00002", "69a7dddd00004"}
    # both seen for the first time, so the UID decides (never CREATED, which the
    # booker writes): Trent's 2 GPUs do not fit beside Peggy's 3 on 4
    assert reasons["69a6bbbb00002"].startswith("overlaps another booking on host gpu2 from ")
    assert "which was booked at the same time" in reasons["69a6bbbb00002"]
    # Peggy's booking is named by its time, never by her title or UID
    assert "Peggy" not in reasons["69a6bbbb00002"]
    assert "69a5aaaa" not in reasons["69a6bbbb00002"]
    assert "unknown host 'gpu3'" in reasons["69a7dddd00004"]
    trent = next(item for item in found.rejected if item.key.startswith("69a6bbbb"))
    assert (trent.user, trent.email) == ("trent", "trent@example.org")
    # the TENTATIVE booking (awaiting approval) is neither kept nor rejected...
    keys = [item.key for item in found.reservations] + [item.key for item in found.rejected]
    assert not any("69a7c0ffee001" in key for key in keys)
    # ...unless the calendar accepts tentative bookings
    accepting = config_for({"user_from": "organizer", "accept_tentative": True})
    accepted = read("librebooking.ics", accepting, "2026-03-16", "2026-03-31")
    oscar = next(item for item in accepted.reservations if item.user == "oscar")
    assert (oscar.tentative, oscar.gpus, oscar.host) == (True, 4, "gpu2")


def test_bookings_that_must_be_rejected_each_with_its_reason() -> None:
    config = config_for({"host": "gpu1"}, allowed_users=["alice", "bob", "zoe"])
    found = read("rejected.ics", config, "2026-05-01", "2026-05-31")
    # every other object still counts; the event without UID too, keyed by its content
    assert [(item.key, item.uid_derived) for item in found.reservations] == [
        ("derived-e0185869d1970d6fe6223075a2f697d5", True),
        ("good-one", False),
    ]
    reasons = {item.key: item.reason for item in found.rejected}
    assert reasons == {
        "bad-login": "'Alice Martin' (from the title) is not a login: lower-case letters, "
        "digits, '_' and '-', starting with a letter or '_', at most 32",
        "not-allowed": "user 'eve' may not book (not in reservations.allowed_users)",
        "unknown-template": "unknown template 'caffe' (templates: digits, pytorch, tensorflow)",
        "unknown-cuda": "CUDA '10.2' is not available for template 'pytorch' "
        "(choose one of: 12.4, 11.8)",
        "too-many-gpus": "8 GPUs asked, but host 'gpu1' has 4",
        "gpus-in-words": "'two' is not a number of GPUs: write a whole number from 1 to 4, "
        "or 'all'",
        "gpus-zero": "0 GPUs: a booking takes at least 1 GPU",
        "ends-before-start": "it ends before it starts",
        "too-long": "it lasts 10d, longer than the site's maximum of 7d",
        "no-end": "it ends when it starts (no end time, or a zero length)",
        "bad-start": "DTSTART '2026-05-10' is not a date or a date-time",
        "unknown-zone": "unknown time zone 'Mars/Olympus_Mons' (no VTIMEZONE defines it)",
        "every-minute": "RRULE repeats minutely; a booking repeats at most daily",
        "../../etc/passwd": "the event's UID cannot name a reservation (it has '/', '\\' or "
        "control characters, or is longer than 255)",
    }
    # who to tell, when the event says it
    by_key = {item.key: item for item in found.rejected}
    assert by_key["unknown-cuda"].user == "alice"
    assert by_key["too-long"].start == utc("2026-05-10T08:00:00")


# --- the oracle ---------------------------------------------------------------------------

ORACLE_CASES = [
    ("google.ics", "2026-03-15", "2026-04-30"),
    ("outlook.ics", "2026-03-01", "2026-11-30"),
    ("nextcloud.ics", "2026-03-01", "2026-06-30"),
    ("thunderbird.ics", "2026-03-16", "2026-04-05"),
    ("librebooking.ics", "2026-03-16", "2026-03-31"),
]


def _as_utc(value: date | datetime, zone: ZoneInfo) -> datetime:
    if not isinstance(value, datetime):
        return datetime.combine(value, time(), zone).astimezone(UTC)
    if value.tzinfo is None:
        return value.replace(tzinfo=zone).astimezone(UTC)
    return value.astimezone(UTC)


def oracle(data: bytes, start: datetime, end: datetime) -> set[tuple[str, datetime, datetime]]:
    """Occurrence times by icalendar + recurring-ical-events (floating: Paris)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # icalendar warns about /mozilla.org/ TZIDs
        found = set()
        for calendar in icalendar.Calendar.from_ical(data, multiple=True):
            for event in recurring_ical_events.of(calendar).between(start, end):
                if str(event.get("STATUS", "")).upper() == "CANCELLED":
                    continue
                if "DTEND" in event:
                    event_end = _as_utc(event.decoded("DTEND"), PARIS)
                else:
                    event_end = _as_utc(event.decoded("DTSTART"), PARIS) + event.decoded("DURATION")
                found.add((str(event["UID"]), _as_utc(event.decoded("DTSTART"), PARIS), event_end))
    return found


@pytest.mark.parametrize(("name", "start", "end"), ORACLE_CASES)
def test_occurrence_times_agree_with_recurring_ical_events(name: str, start: str, end: str) -> None:
    data = (CORPUS / name).read_bytes()
    occurrences, problems = expand([(name, parse_object(data))], utc(start), utc(end), PARIS)
    assert problems == []
    mine = {(item.uid, item.start, item.end) for item in occurrences}
    assert mine == oracle(data, utc(start), utc(end))
    assert len(mine) >= 4
